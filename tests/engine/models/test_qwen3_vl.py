"""Qwen3-VL (``builtin:tiny-qwen3-vl``): greedy output equals HF's
``Qwen3VLForConditionalGeneration`` with HF's image processor on the same images, token for
token (fp32), with one and two images per prompt at different sizes (different grids, so
different resampled position embeddings and M-RoPE positions), under chunked prefill that splits
an image's tokens (and so its deepstack rows), preemption and prefix caching; the positions equal
HF's ``get_rope_index``; TP = 2 equals TP = 1 is in test_qwen_vl_parallel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_qwen_vl_models import IMAGE_PLACEHOLDER as P
from engine.builtin.tiny_qwen_vl_models import make_tiny_qwen3_vl
from engine.errors import ConfigError
from engine.hf_config import check_hf_config
from engine.models.qwen2_5_vl import mrope_axes
from engine.vlm_config import flatten_vlm_config
from tests.engine.qwen_vl_reference import MAX_TOKENS, Reference
from tests.engine.vlm_checks import assert_released, encoder_stats, features, image

MODEL = "builtin:tiny-qwen3-vl"
ONE = f"<|im_start|>user\n{P}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{P} and then {P}\nCompare the two.<|im_end|>\n<|im_start|>assistant\n"
# After smart_resize (multiples of 32): grids 4x6, 8x4, 6x10, 12x8, 4x4 and 6x4 patches, i.e.
# 6, 8, 15, 24, 4 and 6 image tokens; only the 4x4 one is the position table's own size.
SIZES = [(64, 96), (128, 64), (100, 160), (200, 120), (40, 40), (96, 64)]
IMAGES = [image(10 + i, h, w) for i, (h, w) in enumerate(SIZES)]
CASES: list[tuple[str, list[Image.Image]]] = [
    (ONE, [IMAGES[0]]),
    (ONE, [IMAGES[3]]),
    (TWO, [IMAGES[2], IMAGES[1]]),
    (TWO, [IMAGES[4], IMAGES[5]]),
]


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference(resolve_model_source(MODEL))


@pytest.fixture(scope="module")
def expected(ref: Reference) -> list[list[int]]:
    return [ref.generate(text, images) for text, images in CASES]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompt(text: str, images: list[Image.Image]) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def test_interleaved_sections() -> None:
    # HF's recomposition: pair 3i + 1 takes h (i < 3), 3i + 2 takes w (i < 3), the rest t.
    assert mrope_axes(16, [2, 3, 3], interleaved=True)[:8].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_axes(16, [2, 3, 3])[:8].tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


def test_positions_equal_hf_get_rope_index(ref: Reference) -> None:
    llm = LLM(MODEL)
    for text, images in CASES:
        inputs = ref.inputs(text, images)
        want, delta = ref.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        ids = llm.get_tokenizer().encode(text)
        ids, feats = llm.llm_engine.inputs.process_multimodal(_prompt(text, images), ids)
        assert ids == inputs["input_ids"][0].tolist()
        mrope = llm.llm_engine.inputs.mrope_positions(ids, feats)
        assert mrope is not None and mrope.delta == int(delta)
        assert np.array_equal(mrope.array(), want[:, 0].numpy())


SETTINGS = {
    "defaults": {},
    # 8-token chunks: the 24- and 15-token images (and their deepstack rows) span steps.
    "chunked_prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    "preempt_recompute": {"num_kv_blocks": 8, "preemption_mode": "recompute"},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(expected: list[list[int]], setting: str) -> None:
    llm = LLM(MODEL, **SETTINGS[setting])
    outputs = llm.generate([_prompt(*case) for case in CASES], _params(), use_tqdm=False)
    for i, (out, e) in enumerate(zip(outputs, expected)):
        assert list(out.outputs[0].token_ids) == e, f"{setting}: case {i} differs"
    if setting.startswith("preempt"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the setting did not force preemption"
    assert encoder_stats(llm)["num_encoded"] == sum(len(imgs) for _, imgs in CASES)
    assert len({tuple(e) for e in expected}) == len(expected)
    assert_released(llm)


def test_prefix_caching_by_image(ref: Reference, expected: list[list[int]]) -> None:
    llm = LLM(MODEL, enable_prefix_caching=True, max_num_seqs=1)
    other = (ONE, [image(99, 64, 96)])  # the first case's grid, another image
    cases = [CASES[0], other, CASES[0]]
    got = [
        list(llm.generate(_prompt(*case), _params(), use_tqdm=False)[0].outputs[0].token_ids)
        for case in cases
    ]
    assert got[0] == got[2] == expected[0]
    assert got[1] == ref.generate(*other) != got[0]
    last = llm.generate(_prompt(*CASES[0]), _params(), use_tqdm=False)[0]
    assert last.num_cached_tokens > max(f.end for f in features(llm, _prompt(*CASES[0])))
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
        got = llm.generate(_prompt(*case), _params(), use_tqdm=False)[0]
        assert list(got.outputs[0].token_ids) == reference.generate(*case)


def test_unservable_tower_config_is_refused_by_name() -> None:
    import json

    raw = json.loads((resolve_model_source(MODEL) / "config.json").read_text())
    raw["vision_config"]["num_position_embeddings"] = 15
    with pytest.raises(ConfigError, match="num_position_embeddings"):
        check_hf_config(flatten_vlm_config(raw))
