"""``builtin:tiny-qwen3-reasoning``: HF transformers loads it; its think tags are single added
tokens that decoding keeps; its template is Qwen3's hybrid one; the engine's greedy tokens equal
HF's in fp32, think tokens included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_reasoning_models import (
    REASONING_VOCAB_SIZE,
    THINK_END_ID,
    THINK_START_ID,
    make_tiny_reasoning_model,
)

MODEL = "builtin:tiny-qwen3-reasoning"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_source(MODEL)


def test_think_tags_are_single_kept_tokens(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.encode("<think>", add_special_tokens=False) == [THINK_START_ID]
    assert tokenizer.encode("a</think>b", add_special_tokens=False)[1] == THINK_END_ID
    assert {THINK_START_ID, THINK_END_ID}.isdisjoint(tokenizer.all_special_ids)
    ids = tokenizer.encode("<think>x</think>y", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>y"


def test_template_is_qwen3s_hybrid_one(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet back</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    # Earlier turns keep only their answer; the generation prompt leaves thinking to the model.
    assert "greet back" not in text and "<|im_start|>assistant\nHello!<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    off = tokenizer.apply_chat_template(
        history, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert off == text + "<think>\n\n</think>\n\n"


def test_same_files_from_the_same_recipe(tmp_path: Path, model_dir: Path) -> None:
    make_tiny_reasoning_model(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_engine_matches_hf_greedy_with_think_tokens(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is two plus two?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip
    # Biased as the serving tests bias it: the think tokens appear in the output.
    bias = {THINK_START_ID: 6.0, THINK_END_ID: 8.0}
    params = SamplingParams(temperature=0, max_tokens=16, logit_bias=bias)
    llm = LLM(MODEL, num_kv_blocks=64, device="cpu", dtype="float32")
    ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config.vocab_size == REASONING_VOCAB_SIZE
    ids = torch.tensor([prompt])
    offsets = torch.zeros(REASONING_VOCAB_SIZE)
    for token, value in bias.items():
        offsets[token] = value
    with torch.no_grad():
        for _ in range(16):
            logits = model(ids).logits[0, -1] + offsets
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    theirs = ids[0, len(prompt) :].tolist()
    assert list(ours.token_ids) == theirs
    assert THINK_START_ID in theirs and THINK_END_ID in theirs
