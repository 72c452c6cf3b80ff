"""Qwen3-VL (``builtin:tiny-qwen3-vl``): greedy output equals HF's
``Qwen3VLForConditionalGeneration`` with HF's image processor on the same images, token for
token (fp32), with one and two images per prompt at different sizes (different grids, so
different resampled position embeddings and M-RoPE positions), under chunked prefill that splits
an image's tokens (and so its deepstack rows), preemption and prefix caching; the positions equal
HF's ``get_rope_index``; TP = 2 equals TP = 1 is in test_qwen_vl_parallel."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_qwen_vl_models import IMAGE_PLACEHOLDER as P
from engine.builtin.tiny_qwen_vl_models import make_tiny_qwen3_vl
from engine.errors import ConfigError
from engine.hf_config import check_hf_config
from engine.models.qwen2_5_vl import mrope_axes
from engine.vlm_config import flatten_vlm_config
from tests.engine.qwen_vl_reference import MAX_TOKENS, Reference, assert_positions_equal_hf
from tests.engine.vlm_checks import (
    assert_released,
    assert_setting_kept_hf_tokens,
    cases,
    features,
    generate,
    greedy,
    image,
    mm_prompt,
    one_at_a_time,
    seeded_images,
)

MODEL = "builtin:tiny-qwen3-vl"
ONE = f"<|im_start|>user\n{P}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{P} and then {P}\nCompare the two.<|im_end|>\n<|im_start|>assistant\n"
# After smart_resize (multiples of 32): grids 4x6, 8x4, 6x10, 12x8, 4x4 and 6x4 patches, i.e.
# 6, 8, 15, 24, 4 and 6 image tokens; only the 4x4 one is the position table's own size.
SIZES = [(64, 96), (128, 64), (100, 160), (200, 120), (40, 40), (96, 64)]
IMAGES = seeded_images(SIZES, first_seed=10)
CASES = cases(ONE, TWO, IMAGES, ((0,), (3,), (2, 1), (4, 5)))


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference(resolve_model_source(MODEL))


def test_interleaved_sections() -> None:
    # HF's recomposition: pair 3i + 1 takes h (i < 3), 3i + 2 takes w (i < 3), the rest t.
    assert mrope_axes(16, [2, 3, 3], interleaved=True)[:8].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_axes(16, [2, 3, 3])[:8].tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


def test_positions_equal_hf_get_rope_index(ref: Reference) -> None:
    assert len(assert_positions_equal_hf(ref, MODEL, CASES)) == len(CASES)


SETTINGS = {
    "defaults": {},
    # 8-token chunks: the 24- and 15-token images (and their deepstack rows) span steps.
    "chunked_prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    "preempt_recompute": {"num_kv_blocks": 8, "preemption_mode": "recompute"},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(expected: list[list[int]], setting: str) -> None:
    llm, got = generate(MODEL, CASES, MAX_TOKENS, **SETTINGS[setting])
    assert_setting_kept_hf_tokens(llm, setting, got, expected, CASES)
    assert len({tuple(e) for e in expected}) == len(expected)


def test_prefix_caching_by_image(ref: Reference, expected: list[list[int]]) -> None:
    llm = LLM(MODEL, enable_prefix_caching=True, max_num_seqs=1)
    other = (ONE, [image(99, 64, 96)])  # the first case's grid, another image
    got = one_at_a_time(llm, [CASES[0], other, CASES[0]], MAX_TOKENS)
    assert got[0] == got[2] == expected[0]
    assert got[1] == ref.generate(*other) != got[0]
    last = llm.generate(mm_prompt(*CASES[0]), greedy(MAX_TOKENS), use_tqdm=False)[0]
    assert last.num_cached_tokens > max(f.end for f in features(llm, mm_prompt(*CASES[0])))
    assert llm.llm_engine.block_manager.prefix_hits > 0
    assert_released(llm)


def test_deepstack_past_the_last_layer_and_a_larger_table(tmp_path: Path) -> None:
    # Deepstack from three tower layers into a 2-layer language model (HF adds only as many
    # as there are layers), an 8x8 position table; chunked prefill.
    path = make_tiny_qwen3_vl(
        tmp_path,
        seed=4,
        vision_overrides={"num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1, 2]},
        text_overrides={"num_hidden_layers": 2},
    )
    reference = Reference(path)
    llm = LLM(str(path), max_num_batched_tokens=6)
    for case in CASES[1:3]:
        got = llm.generate(mm_prompt(*case), greedy(MAX_TOKENS), use_tqdm=False)[0]
        assert list(got.outputs[0].token_ids) == reference.generate(*case)


def test_unservable_tower_config_is_refused_by_name() -> None:
    import json

    raw = json.loads((resolve_model_source(MODEL) / "config.json").read_text())
    raw["vision_config"]["num_position_embeddings"] = 15
    with pytest.raises(ConfigError, match="num_position_embeddings"):
        check_hf_config(flatten_vlm_config(raw))
