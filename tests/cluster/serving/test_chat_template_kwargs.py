"""``chat_template_kwargs`` as vLLM takes them, through the chat route's payload and the
front's render: variables for the model's own template (those it does not read are dropped),
the request's own fields winning over them, ``chat_template`` and ``tokenize`` refused. The
reference is Hugging Face's ``apply_chat_template`` on the same checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from cluster.api.api_errors import APIError
from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import chat_payload
from cluster.serving.request_inputs import request_chat_prompt
from engine.builtin.catalog import resolve_model_source
from engine.errors import InvalidRequestError

# Its template reads enable_thinking: False renders an empty, closed think block.
SOURCE = "builtin:tiny-qwen3-reasoning"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_source(SOURCE))


def _prompt_ids(tokenizer: Any, **fields: Any) -> list[int]:
    request = chat_payload(ChatCompletionRequest(model="m", messages=MESSAGES, **fields))
    return request_chat_prompt(tokenizer, request, None, None)["prompt_token_ids"]


def _hf(tokenizer: Any, **kwargs: Any) -> list[int]:
    return tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )


def test_a_variable_the_template_reads_renders_as_hugging_face_renders_it(tokenizer: Any) -> None:
    off = _prompt_ids(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert off == _hf(tokenizer, enable_thinking=False) != _hf(tokenizer)
    # Variables it does not read are dropped, as are those the request's fields set.
    noisy = {
        "enable_thinking": False,
        "not_read": 1,
        "messages": [],
        "add_generation_prompt": False,
    }
    assert _prompt_ids(tokenizer, chat_template_kwargs=noisy) == off


def test_reasoning_effort_sets_enable_thinking_unless_the_kwargs_do(tokenizer: Any) -> None:
    assert _prompt_ids(tokenizer, reasoning_effort="none") == _hf(tokenizer, enable_thinking=False)
    on = _prompt_ids(tokenizer, reasoning_effort="low")
    assert on == _hf(tokenizer, reasoning_effort="low", enable_thinking=True)
    kwargs = {"enable_thinking": False}
    off = _prompt_ids(tokenizer, reasoning_effort="low", chat_template_kwargs=kwargs)
    assert off == _hf(tokenizer, enable_thinking=False) != on


@pytest.mark.parametrize("name", ["chat_template", "tokenize"])
def test_a_kwarg_that_is_no_template_variable_is_a_400_naming_the_field(name: str) -> None:
    req = ChatCompletionRequest(model="m", messages=MESSAGES, chat_template_kwargs={name: "x"})
    with pytest.raises(APIError) as info:
        chat_payload(req)
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")


def test_a_template_with_a_generation_block_still_reads_them(tokenizer: Any) -> None:
    """Hugging Face's ``{% generation %}`` tag (training templates) does not hide the variables."""
    marked = AutoTokenizer.from_pretrained(resolve_model_source(SOURCE))
    marked.chat_template = (
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}off{% endif %}"
    )
    off = _prompt_ids(marked, chat_template_kwargs={"enable_thinking": False})
    assert marked.decode(off) == "Hioff"


def test_gpt_oss_takes_only_the_reasoning_effort() -> None:
    """gpt-oss's prompt is harmony's: only its system message's fields reach it (a variable of
    the template's own, or a function it calls, does not), and an effort harmony has no level
    for is a 400 naming ``reasoning_effort``."""
    harmony = AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-gpt-oss"))
    plain = _prompt_ids(harmony, reasoning_effort="high")
    others = {"strftime_now": 1, "raise_exception": 1, "found": True, "enable_thinking": False}
    assert _prompt_ids(harmony, reasoning_effort="high", chat_template_kwargs=others) == plain
    assert plain != _prompt_ids(harmony, reasoning_effort="low")
    with pytest.raises(InvalidRequestError) as info:
        _prompt_ids(harmony, reasoning_effort="none")
    assert info.value.param == "reasoning_effort"
