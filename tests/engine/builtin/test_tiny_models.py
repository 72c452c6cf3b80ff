"""Built-in tiny models: offline HF checkpoints with a real byte-level BPE tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.builtin import tiny_models
from engine.builtin.builtin_names import TINY_MODEL_NAMES, VERSION
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_models import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    make_tiny_model,
)

ROOT = Path(__file__).resolve().parents[3]

# (architecture, num_key_value_heads, tie_word_embeddings, head_dim, num_hidden_layers)
EXPECTED_SHAPE = {
    "tiny-llama": ("LlamaForCausalLM", 2, False, 16, 2),
    "tiny-mistral": ("MistralForCausalLM", 1, False, 16, 2),
    "tiny-qwen2": ("Qwen2ForCausalLM", 2, True, 16, 2),
    "tiny-qwen3": ("Qwen3ForCausalLM", 2, False, 32, 2),
    "tiny-gemma2": ("Gemma2ForCausalLM", 2, True, 32, 3),
    "tiny-gemma3": ("Gemma3ForCausalLM", 1, True, 32, 3),
    "tiny-phi3": ("Phi3ForCausalLM", 2, False, 16, 2),
}
MULTILINGUAL = "naïve café, Ελληνικά, русский, 日本語, 🙂"
GAP_PROMPTS = (
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Question: Why is the sky blue?\nAnswer:",
    "Смотритель маяка",
    "日本語の文章",
    "1, 2, 3, 4,",
    "The scheduler keeps a list of tasks",
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("llm-cluster-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLM_CLUSTER_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def model_dirs(cache_dir: Path) -> dict[str, Path]:
    return {name: resolve_model_source(f"builtin:{name}") for name in TINY_MODEL_NAMES}


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_loads_with_hf_auto_classes_and_gives_finite_logits(
    model_dirs: dict[str, Path], name: str
) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs[name], local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[name], local_files_only=True)
    architecture, num_kv_heads, tied, head_dim, num_layers = EXPECTED_SHAPE[name]
    config = model.config

    assert type(model).__name__ == architecture
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, num_kv_heads)
    assert (config.hidden_size, config.head_dim, config.num_hidden_layers) == (
        64,
        head_dim,
        num_layers,
    )
    assert config.tie_word_embeddings is tied
    assert config.vocab_size == len(tokenizer)
    input_ids = torch.tensor([tokenizer.encode("The river and the stone")])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_qwen2_has_nonzero_qkv_bias(model_dirs: dict[str, Path]) -> None:
    weights = load_file(model_dirs["tiny-qwen2"] / "model.safetensors")

    for proj in ("q_proj", "k_proj", "v_proj"):
        assert weights[f"model.layers.0.self_attn.{proj}.bias"].abs().min() > 0


def test_tied_checkpoint_stores_the_embedding_once(model_dirs: dict[str, Path]) -> None:
    tied = load_file(model_dirs["tiny-qwen2"] / "model.safetensors")
    untied = load_file(model_dirs["tiny-llama"] / "model.safetensors")

    assert "lm_head.weight" not in tied
    assert "lm_head.weight" in untied


def test_same_seed_gives_identical_weights_and_another_seed_differs(tmp_path: Path) -> None:
    first = make_tiny_model("tiny-llama", tmp_path / "a", seed=0)
    again = make_tiny_model("tiny-llama", tmp_path / "b", seed=0)
    other = make_tiny_model("tiny-llama", tmp_path / "c", seed=1)

    first_bytes = (first / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == first_bytes
    assert (other / "model.safetensors").read_bytes() != first_bytes
    first_weights = load_file(first / "model.safetensors")
    other_weights = load_file(other / "model.safetensors")
    embed = "model.embed_tokens.weight"
    assert not torch.equal(first_weights[embed], other_weights[embed])


def test_tokenizer_round_trips_multibyte_text(model_dirs: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["tiny-llama"], local_files_only=True)

    ids = tokenizer.encode(MULTILINGUAL, add_special_tokens=False)

    assert tokenizer.decode(ids) == MULTILINGUAL


def test_tokenizer_splits_a_multibyte_character_across_tokens(
    model_dirs: dict[str, Path],
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["tiny-llama"], local_files_only=True)

    ids = tokenizer.encode("🙂", add_special_tokens=False)

    assert len(ids) > 1
    assert all("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)


def test_all_models_and_loaders_give_the_same_token_ids(model_dirs: dict[str, Path]) -> None:
    # transformers 5 rebuilds a qwen2 tokenizer's pre-tokenizer itself; the ids must still agree
    # with the raw tokenizer.json and with the other two models.
    expected = Tokenizer.from_file(str(model_dirs["tiny-llama"] / "tokenizer.json"))
    expected_ids = expected.encode(MULTILINGUAL).ids

    for name in TINY_MODEL_NAMES:
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[name], local_files_only=True)
        assert tokenizer.encode(MULTILINGUAL) == expected_ids, name


def test_encoding_a_prompt_prepends_exactly_one_bos(model_dirs: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["tiny-mistral"], local_files_only=True)

    ids = tokenizer.encode("hello world")

    assert ids[0] == BOS_TOKEN_ID
    assert ids.count(BOS_TOKEN_ID) == 1
    assert ids[-1] != EOS_TOKEN_ID


def test_chat_template_renders_conversation_with_generation_prompt(
    model_dirs: dict[str, Path],
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["tiny-qwen2"], local_files_only=True)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a river."},
    ]

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )

    assert text == (
        "<s><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nName a river.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids.count(BOS_TOKEN_ID) == 1


# The template before it learned tools: without tools, the current one must render the same bytes.
PLAIN_CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS_SECTION_END = (
    "\n</tools>\n\nTo call a function, answer with one JSON object per call, each inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call><|im_end|>\n'
)


@pytest.fixture(scope="module")
def chat_tokenizer(model_dirs: dict[str, Path]) -> Any:
    return AutoTokenizer.from_pretrained(model_dirs["tiny-qwen2"], local_files_only=True)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Name a river."}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a river."},
            {"role": "assistant", "content": "The Rhine."},
            {"role": "user", "content": "Another, <tool_call> and all."},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_without_tools_is_plain_chatml(
    chat_tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}

    text = chat_tokenizer.apply_chat_template(messages, **kwargs)
    plain = chat_tokenizer.apply_chat_template(messages, chat_template=PLAIN_CHATML, **kwargs)

    assert text == plain


def test_chat_template_renders_none_content_as_empty(chat_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]

    text = chat_tokenizer.apply_chat_template(messages, tokenize=False)

    assert text == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"


def test_chat_template_lists_tools_after_the_system_message(chat_tokenizer: Any) -> None:
    bare_function = {"name": "now", "parameters": {"type": "object"}}
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo?"},
    ]

    text = chat_tokenizer.apply_chat_template(
        messages, tools=[WEATHER_TOOL, bare_function], tokenize=False, add_generation_prompt=True
    )

    assert text == (
        "<s><|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions "
        "to answer. Their signatures are listed as JSON inside <tools></tools>:\n<tools>\n"
        + json.dumps(WEATHER_TOOL)
        + "\n"
        + json.dumps({"type": "function", "function": bare_function})
        + TOOLS_SECTION_END
        + "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_with_tools_and_no_system_message_opens_with_the_tools(
    chat_tokenizer: Any,
) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]

    text = chat_tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False)

    assert text.startswith("<s><|im_start|>system\n# Tools\n\n")
    assert text.endswith(TOOLS_SECTION_END + "<|im_start|>user\nWeather in Oslo?<|im_end|>\n")


def test_chat_template_renders_tool_calls_and_tool_results(chat_tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "17 C"},
        {"role": "assistant", "content": "Cold, then mild."},
    ]

    text = chat_tokenizer.apply_chat_template(messages, tokenize=False)

    assert text == (
        "<s><|im_start|>user\nWeather in Oslo and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response>\n"
        "<tool_response>\n17 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nCold, then mild.<|im_end|>\n"
    )


def test_chat_template_puts_assistant_content_before_its_tool_calls(chat_tokenizer: Any) -> None:
    call = {"function": {"name": "now", "arguments": {}}}
    messages = [{"role": "assistant", "content": "Checking.", "tool_calls": [call]}]

    text = chat_tokenizer.apply_chat_template(messages, tokenize=False)

    assert text == (
        "<s><|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_generation_config_stops_on_eos_and_im_end(model_dirs: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs["tiny-llama"], local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["tiny-llama"], local_files_only=True)

    assert tokenizer.eos_token == "</s>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END_TOKEN_ID
    assert model.generation_config.eos_token_id == [EOS_TOKEN_ID, IM_END_TOKEN_ID]


def test_resolve_builtin_materializes_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_CLUSTER_CACHE_DIR", str(tmp_path))

    first = resolve_model_source("builtin:tiny-llama")
    written_at = (first / "model.safetensors").stat().st_mtime_ns
    second = resolve_model_source("builtin:tiny-llama")

    assert first == second == tmp_path / "models" / f"tiny-llama-v{VERSION}"
    assert (second / "model.safetensors").stat().st_mtime_ns == written_at
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]


def test_a_written_builtin_resolves_without_importing_a_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process of a start checks its config (the replica, the head, each worker): a
    built-in written before resolves from its name alone, neither the generators nor
    transformers imported (they cost 1-3 s per process)."""
    monkeypatch.setenv("LLM_CLUSTER_CACHE_DIR", str(tmp_path))
    written = resolve_model_source("builtin:tiny-qwen3-moe")
    probe = (
        "import sys; from engine.builtin.catalog import resolve_model_source; "
        "print(resolve_model_source('builtin:tiny-qwen3-moe')); "
        "print(sorted(m for m in sys.modules if m.startswith(('engine.builtin.tiny', "
        "'transformers', 'torch'))))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, cwd=ROOT, check=True).stdout.splitlines()  # fmt: skip
    assert out == [str(written), "[]"]


def test_the_name_tables_and_the_generators_agree() -> None:
    """Each pooling recipe has its name in ``builtin_names`` and the reverse; no two built-ins
    share a cache directory."""
    from engine.builtin.builtin_names import (
        BUILTIN_MODEL_NAMES,
        TINY_POOLING_MODEL_NAMES,
        builtin_dirname,
    )
    from engine.builtin.tiny_pooling_models import _RECIPES

    assert set(_RECIPES) == set(TINY_POOLING_MODEL_NAMES)
    dirnames = [builtin_dirname(name) for name in BUILTIN_MODEL_NAMES]
    assert len(set(dirnames)) == len(dirnames) == len(set(BUILTIN_MODEL_NAMES))


def test_losing_the_rename_race_uses_the_winners_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_CLUSTER_CACHE_DIR", str(tmp_path))
    real_make = tiny_models.make_tiny_model

    def make_after_a_rival_finished(name: str, out_dir: Path, seed: int = 0) -> Path:
        # A rival process completes its whole materialization while this one is still writing.
        monkeypatch.setattr(tiny_models, "make_tiny_model", real_make)
        winner = resolve_model_source(f"builtin:{name}")
        (winner / "winner").touch()
        return real_make(name, out_dir, seed)

    monkeypatch.setattr(tiny_models, "make_tiny_model", make_after_a_rival_finished)

    path = resolve_model_source("builtin:tiny-llama")

    assert (path / "winner").exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]


def test_unknown_builtin_name_raises_value_error_listing_valid_names() -> None:
    with pytest.raises(ValueError, match="tiny-llama, tiny-mistral, tiny-qwen2"):
        resolve_model_source("builtin:tiny-gpt")


def test_missing_local_path_raises_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"

    with pytest.raises(FileNotFoundError, match=str(missing)):
        resolve_model_source(str(missing))


def test_local_directory_with_config_resolves_to_itself(model_dirs: dict[str, Path]) -> None:
    assert resolve_model_source(str(model_dirs["tiny-mistral"])) == model_dirs["tiny-mistral"]


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_greedy_top2_logit_gap_is_large(model_dirs: dict[str, Path], name: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs[name], local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[name], local_files_only=True)
    gaps: list[float] = []
    generated: list[list[int]] = []

    for prompt in GAP_PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=32,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        generated.append(out.sequences[0, inputs["input_ids"].shape[1] :].tolist())
        for logits in out.logits:
            top2 = logits[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))

    assert min(gaps) > 1e-4
    # Never stopped early on </s> or <|im_end|>, and did not collapse into one repeated token
    # (tiny-gemma3, one KV head for four query heads, loops over a few tokens on some prompts).
    assert all(len(tokens) == 32 for tokens in generated)
    assert all(len(set(tokens)) >= 4 for tokens in generated)
    assert sum(len(set(tokens)) for tokens in generated) > 8 * len(generated)


def test_bench_model_tokenizer_covers_its_vocabulary(tmp_path: Path) -> None:
    """A random bench Llama with vocab 32000: its tokenizer has exactly 32000 tokens, the tiny
    models' 1024 with the same ids first, every id decodes to text (none to nothing), and
    transformers' loader decodes and encodes the same as the raw tokenizer."""
    out = tiny_models.make_random_llama(
        tmp_path, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, vocab_size=32000,
    )  # fmt: skip
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert raw.get_vocab_size() == 32000
    vocab = raw.get_vocab()
    assert sorted(vocab.values()) == list(range(32000))
    base = tiny_models.build_tokenizer().get_vocab()
    assert all(vocab[token] == token_id for token, token_id in base.items())
    empty = [i for i in range(5, 32000) if raw.decode([i]) == ""]
    assert empty == []
    hf = AutoTokenizer.from_pretrained(out)
    ids = list(range(5, 32000, 97))
    assert hf.decode(ids) == raw.decode(ids)
    text = "The river froze, and the baker walked to the market."
    assert hf(text).input_ids == raw.encode(text).ids
    assert hf.decode(raw.encode(text).ids, skip_special_tokens=True) == text
