"""Qwen2.5-VL (``builtin:tiny-qwen2.5-vl``): greedy output equals HF's
``Qwen2_5_VLForConditionalGeneration`` with HF's Qwen2-VL image processor on the same images,
token for token (fp32), with one and two images per prompt at different sizes (different
patch grids, so different M-RoPE positions and windows), under chunked prefill that splits an
image's tokens, preemption and prefix caching, and under a LoRA adapter on the language model
(HF + PEFT); the 3-D positions equal HF's ``get_rope_index``; what the engine does not serve
is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import LLM
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_qwen_vl_models import IMAGE_PLACEHOLDER, make_tiny_qwen2_5_vl
from engine.errors import ConfigError, InvalidRequestError
from engine.hf_config import check_hf_config
from engine.vlm_config import flatten_vlm_config
from tests.engine.qwen_vl_reference import MAX_TOKENS, Reference, assert_positions_equal_hf
from tests.engine.vlm_checks import (
    assert_lora_equals_peft,
    assert_released,
    assert_same_images_twice_hit_the_prefix_cache,
    assert_setting_kept_hf_tokens,
    cases,
    generate,
    greedy,
    hf_greedy,
    image,
    language_model_lora,
    one_at_a_time,
    seeded_images,
)

MODEL = "builtin:tiny-qwen2.5-vl"
P = IMAGE_PLACEHOLDER
ONE = f"<|im_start|>user\n{P}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{P} and then {P}\nCompare the two.<|im_end|>\n<|im_start|>assistant\n"

# After smart_resize (multiples of 28): grids 4x6, 8x4, 6x10, 14x8, 2x2, 4x10 patches, i.e.
# 6, 8, 15, 28, 1 and 10 image tokens.
SIZES = [(56, 84), (112, 60), (90, 150), (200, 120), (33, 33), (64, 150)]
IMAGES = seeded_images(SIZES)
CASES = cases(ONE, TWO, IMAGES, ((0,), (3,), (2, 1), (4, 5)))


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference(resolve_model_source(MODEL))


def test_positions_equal_hf_get_rope_index(ref: Reference) -> None:
    for ids, mrope, want in assert_positions_equal_hf(ref, MODEL, CASES):
        # A range past the prompt: the text position plus the delta on every axis.
        tail = mrope.for_range(len(ids) - 2, len(ids) + 3)
        assert np.array_equal(tail[:, :2], want[:, -2:])
        assert np.array_equal(tail[:, 2:], np.tile(np.arange(3) + len(ids) + mrope.delta, (3, 1)))


SETTINGS = {
    "defaults": {},
    # 8-token chunks: the 28- and 15-token images span several steps.
    "chunked_prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    "preempt_recompute": {"num_kv_blocks": 8, "preemption_mode": "recompute"},
    "preempt_swap": {"num_kv_blocks": 8, "preemption_mode": "swap", "swap_space": 0.05},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(expected: list[list[int]], setting: str) -> None:
    llm, got = generate(MODEL, CASES, MAX_TOKENS, **SETTINGS[setting])
    assert_setting_kept_hf_tokens(llm, setting, got, expected, CASES)


def test_answers_depend_on_the_image_and_on_its_grid(expected: list[list[int]]) -> None:
    # Not a model that ignores its images: every case answers differently.
    assert len({tuple(e) for e in expected}) == len(expected)


def test_different_images_behind_the_same_text_get_their_own_answers(
    ref: Reference, expected: list[list[int]]
) -> None:
    llm = LLM(MODEL, enable_prefix_caching=True, max_num_seqs=1)
    # Two images of one size (one grid: the same placeholder ids and positions), then the
    # first again: each gets its own answer, and the repeat hits the cache.
    three = [(ONE, [IMAGES[0]]), (ONE, [image(7, 56, 84)]), (ONE, [IMAGES[0]])]
    got = one_at_a_time(llm, three, MAX_TOKENS)
    assert got[0] == expected[0] and got[2] == expected[0]
    assert got[1] == ref.generate(*three[1]) != got[0]
    assert llm.llm_engine.block_manager.prefix_hits > 0
    assert_released(llm)


def test_same_image_twice_hits_the_prefix_cache(expected: list[list[int]]) -> None:
    assert_same_images_twice_hit_the_prefix_cache(MODEL, CASES[2], expected[2])


def test_prompt_token_ids_and_chat(ref: Reference, expected: list[list[int]]) -> None:
    llm = LLM(MODEL)
    text, images = CASES[2]
    ids = llm.get_tokenizer().encode(text)
    request = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    out = llm.generate(request, greedy(MAX_TOKENS), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == expected[2]
    # Chat content parts: each image part becomes <|vision_start|><|image_pad|><|vision_end|>.
    message = {"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGES[0]},
                                           {"type": "text", "text": "What is it?"}]}  # fmt: skip
    chat = llm.chat([message], greedy(MAX_TOKENS), use_tqdm=False)[0]
    rendered = ref.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{P}\nWhat is it?"}], tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    # A rendered chat starts with its own <s>: tokenized without special tokens.
    want = ref.inputs(rendered, [IMAGES[0]], special=False)["input_ids"][0].tolist()
    assert chat.prompt_token_ids == want
    assert list(chat.outputs[0].token_ids) == ref.generate(rendered, [IMAGES[0]], special=False)


def test_videos_are_refused_by_name() -> None:
    llm = LLM(MODEL)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(
            {"prompt": ONE, "multi_modal_data": {"video": [IMAGES[0]]}}, greedy(MAX_TOKENS)
        )
    assert err.value.param == "multi_modal_data" and "video" in str(err.value)


def _config(**text: Any) -> dict[str, Any]:
    path = resolve_model_source(MODEL)
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(text)
    return raw


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "mrope_section": [2, 2, 3]}}, "mrope_section"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                              "mrope_section": [2, 3, 3]}}, "rope_scaling.type"),
        ({"use_sliding_window": True, "sliding_window": 32}, "use_sliding_window"),
        ({"head_dim": 32}, "head_dim"),
    ],
)  # fmt: skip
def test_config_that_changes_unimplemented_math_is_refused(text: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        check_hf_config(flatten_vlm_config(_config(**text)))


def test_hub_layout_reads_like_the_nested_one() -> None:
    nested = _config()
    text = nested.pop("text_config")
    rope = text.pop("rope_parameters")
    hub = {**text, **nested, "rope_theta": rope["rope_theta"],
           "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}  # fmt: skip
    hub["architectures"] = nested["architectures"]
    hub["model_type"] = "qwen2_5_vl"
    flat_hub, flat_nested = flatten_vlm_config(hub), flatten_vlm_config(_config())
    for key in ("rope_parameters", "mrope_section", "vision_config", "image_token_index",
                "hidden_size", "num_key_value_heads", "vocab_size", "sliding_window"):  # fmt: skip
        assert flat_hub[key] == flat_nested[key], key
    check_hf_config(flat_hub)


def test_a_second_seed_with_larger_windows_and_one_full_attention_layer(tmp_path: Path) -> None:
    # Another tower layout: windows of 4x4 merged units (112 pixels), full attention at layer
    # 0 only; a 3-layer language model. Still HF's tokens, under chunked prefill.
    path = make_tiny_qwen2_5_vl(
        tmp_path,
        seed=5,
        vision_overrides={"window_size": 112, "fullatt_block_indexes": [0], "depth": 3},
        text_overrides={"num_hidden_layers": 3},
    )
    reference = Reference(path)
    two = [CASES[1], CASES[2]]
    _, got = generate(str(path), two, MAX_TOKENS, max_num_batched_tokens=12)
    assert got == [reference.generate(*case) for case in two]


def test_lora_on_the_language_model_equals_hf_peft(ref: Reference, tmp_path: Path) -> None:
    # The adapter targets the language model's layers only (the tower has no q/v_proj, but a
    # down_proj: the pattern keeps it out).
    peft = language_model_lora(type(ref.model), ref.path, tmp_path)
    text, images = CASES[2]
    expected_lora = hf_greedy(peft, ref.inputs(text, images), MAX_TOKENS)
    assert_lora_equals_peft(MODEL, CASES[2], tmp_path, expected_lora, ref.generate(text, images))
