"""``LLM.chat``'s template options, vLLM's: ``chat_template`` for these chats,
``chat_template_kwargs``, ``tools``, ``add_generation_prompt`` and ``continue_final_message``; and
the engine argument ``chat_template`` in place of the tokenizer's. The reference is Hugging
Face's ``apply_chat_template`` with the same options on ``builtin:tiny-qwen3-reasoning``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import LLM, LoRARequest, SamplingParams
from engine.builtin.catalog import make_tiny_lora, resolve_model_source
from engine.errors import InvalidRequestError

ARGS: dict[str, Any] = {"num_kv_blocks": 32, "max_model_len": 256, "device": "cpu"}
ONE = SamplingParams(temperature=0, max_tokens=1)
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if tools %}[{{ tools | length }} tools]{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if persona %}({{ persona }}){% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM("builtin:tiny-qwen3-reasoning", **ARGS)
    yield llm
    llm.llm_engine.shutdown()


def _prompt(llm: LLM, **options: Any) -> list[int]:
    [output] = llm.chat(MESSAGES[:1], ONE, use_tqdm=False, **options)
    return list(output.prompt_token_ids)


def _hf(llm: LLM, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    options.setdefault("add_generation_prompt", True)
    return llm.get_tokenizer().apply_chat_template(
        messages, tokenize=True, return_dict=False, **options
    )


def test_the_options_render_as_hugging_face_renders_them(llm: LLM) -> None:
    assert _prompt(llm) == _hf(llm, MESSAGES[:1])
    quiet = _prompt(llm, chat_template_kwargs={"enable_thinking": False})
    assert quiet == _hf(llm, MESSAGES[:1], enable_thinking=False) != _prompt(llm)
    mine = _prompt(llm, chat_template=TEMPLATE, tools=TOOLS, chat_template_kwargs={"persona": "x"})
    assert llm.get_tokenizer().decode(mine) == "<user>Hi[1 tools]<assistant>(x)"
    bare = _prompt(llm, chat_template=TEMPLATE, add_generation_prompt=False)
    assert llm.get_tokenizer().decode(bare) == "<user>Hi"


def test_continue_final_message_leaves_the_last_message_open(llm: LLM) -> None:
    [output] = llm.chat(MESSAGES, ONE, use_tqdm=False, continue_final_message=True)
    expected = _hf(llm, MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert list(output.prompt_token_ids) == expected
    assert llm.get_tokenizer().decode(expected).endswith("Hel")


def test_the_engine_arguments_replace_the_template_and_set_its_defaults() -> None:
    llm = LLM("builtin:tiny-llama", chat_template=TEMPLATE,
              default_chat_template_kwargs={"persona": "d"}, **ARGS)  # fmt: skip
    try:
        decode = llm.get_tokenizer().decode
        [output] = llm.chat(MESSAGES[:1], ONE, use_tqdm=False)
        assert decode(output.prompt_token_ids) == "<user>Hi<assistant>(d)"
        # A request's own variables over the defaults; render options in them are not taken.
        own = {"persona": "e", "tokenize": False, "tools": None}
        [output] = llm.chat(MESSAGES[:1], ONE, use_tqdm=False, chat_template_kwargs=own)
        assert decode(output.prompt_token_ids) == "<user>Hi<assistant>(e)"
    finally:
        llm.llm_engine.shutdown()


def test_gpt_oss_refuses_a_chat_template() -> None:
    llm = LLM("builtin:tiny-gpt-oss", **ARGS)
    try:
        with pytest.raises(InvalidRequestError) as info:
            llm.chat(MESSAGES[:1], ONE, use_tqdm=False, chat_template=TEMPLATE)
        assert info.value.param == "chat_template"
    finally:
        llm.llm_engine.shutdown()


# Qwen3-Coder's way of reading a call's arguments: a mapping, item by item; and Llama 3.1's test
# for calls, which an empty list passes.
CALLS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% if 'tool_calls' in m %}{% if m.tool_calls | length != 1 %}"
    "{{ raise_exception('one call at a time') }}{% endif %}"
    "{% for call in m.tool_calls %}[{{ call.function.name }}"
    "{% for k, v in call.function.arguments | items %} {{ k }}={{ v }}{% endfor %}]"
    "{% endfor %}{% endif %}{% endfor %}"
)


def test_earlier_tool_calls_reach_the_template_with_their_arguments_as_objects(llm: LLM) -> None:
    def call(arguments: str) -> dict[str, Any]:
        return {"id": "c", "type": "function",
                "function": {"name": "f", "arguments": arguments}}  # fmt: skip

    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris", "n": 2}')]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        {"role": "assistant", "content": "ok", "tool_calls": []},
        {"role": "assistant", "content": None, "tool_calls": [call("not json")]},
    ]
    ids = _prompt_of(llm, history, chat_template=CALLS_TEMPLATE)
    parsed = [
        history[0],
        {
            **history[1],
            "tool_calls": [
                {**call(""), "function": {"name": "f", "arguments": {"city": "Paris", "n": 2}}}
            ],
        },
        history[2],
        {"role": "assistant", "content": "ok"},
        {**history[4], "tool_calls": [{**call(""), "function": {"name": "f", "arguments": {}}}]},
    ]
    assert ids == _hf(llm, parsed, chat_template=CALLS_TEMPLATE)
    text = llm.get_tokenizer().decode(ids)
    assert "[f city=Paris n=2]" in text and "<assistant>ok<assistant>[f]" in text
    assert history[1]["tool_calls"][0]["function"]["arguments"].startswith("{")  # not modified


def _prompt_of(llm: LLM, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    [output] = llm.chat(messages, ONE, use_tqdm=False, **options)
    return list(output.prompt_token_ids)


def test_a_template_that_joins_arguments_to_text_gets_the_text_sent(llm: LLM) -> None:
    joins = "{% for m in messages %}{% for t in m.tool_calls or [] %}{{ '[' + t.function.arguments + ']' }}{% endfor %}{% endfor %}"  # noqa: E501
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": None, "tool_calls": [call]}]  # fmt: skip
    ids = _prompt_of(llm, history, chat_template=joins)
    assert ids == _hf(llm, history, chat_template=joins)
    assert llm.get_tokenizer().decode(ids) == '[{"a":1}]'


def test_chat_under_an_adapter_equals_generate_and_hf_peft_on_the_rendered_prompt(
    tmp_path: Path,
) -> None:
    """``lora_request``, vLLM's: one adapter for every conversation, or a list aligned with
    them; each chat is greedy HF + PEFT on its rendered prompt."""
    path = make_tiny_lora("tiny-llama", tmp_path / "a", 8, ["q_proj", "v_proj", "down_proj"], 1)
    lora = LoRARequest("a", 1, str(path))
    chats = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Tell me more"}]]
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM("builtin:tiny-llama", enable_lora=True, max_lora_rank=8, dtype="float32", **ARGS)
    try:
        mixed = llm.chat(chats, params, use_tqdm=False, lora_request=[lora, None])
        every = llm.chat(chats, params, use_tqdm=False, lora_request=lora)
        base = AutoModelForCausalLM.from_pretrained(
            resolve_model_source("builtin:tiny-llama"), dtype=torch.float32
        )
        for outputs, loras in ((mixed, [lora, None]), (every, [lora, lora])):
            for output, adapter in zip(outputs, loras):
                ids = list(output.prompt_token_ids)
                [direct] = llm.generate([ids], params, use_tqdm=False, lora_request=adapter)
                assert output.outputs[0].token_ids == direct.outputs[0].token_ids
                model = PeftModel.from_pretrained(base, str(path)) if adapter else base
                with torch.no_grad():
                    reference = (
                        model.eval()
                        .generate(
                            torch.tensor([ids]), do_sample=False, max_new_tokens=8, pad_token_id=0
                        )[0, len(ids) :]
                        .tolist()
                    )
                if adapter:
                    model.unload()
                assert list(output.outputs[0].token_ids) == reference
        assert mixed[0].outputs[0].token_ids != mixed[1].outputs[0].token_ids
        [plain] = llm.chat(chats[0], params, use_tqdm=False)
        assert plain.outputs[0].token_ids != mixed[0].outputs[0].token_ids  # the adapter applied
        with pytest.raises(InvalidRequestError, match="has 1 entries for 2 prompts") as info:
            llm.chat(chats, params, use_tqdm=False, lora_request=[lora])
        assert info.value.param == "lora_request"
    finally:
        llm.llm_engine.shutdown()
