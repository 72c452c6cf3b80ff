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
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image

from engine import LLM, LoRARequest, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_qwen_vl_models import IMAGE_PLACEHOLDER, make_tiny_qwen2_5_vl
from engine.errors import ConfigError, InvalidRequestError
from engine.hf_config import check_hf_config
from engine.vlm_config import flatten_vlm_config
from tests.engine.qwen_vl_reference import MAX_TOKENS, Reference
from tests.engine.vlm_checks import assert_released, encoder_stats, features, image

MODEL = "builtin:tiny-qwen2.5-vl"
P = IMAGE_PLACEHOLDER
ONE = f"<|im_start|>user\n{P}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{P} and then {P}\nCompare the two.<|im_end|>\n<|im_start|>assistant\n"

# After smart_resize (multiples of 28): grids 4x6, 8x4, 6x10, 14x8, 2x2, 4x10 patches, i.e.
# 6, 8, 15, 28, 1 and 10 image tokens.
SIZES = [(56, 84), (112, 60), (90, 150), (200, 120), (33, 33), (64, 150)]
IMAGES = [image(i, h, w) for i, (h, w) in enumerate(SIZES)]
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


def _generate(cases: list[tuple[str, list[Image.Image]]], model: str = MODEL, **engine_args: Any):
    llm = LLM(model, **engine_args)
    outputs = llm.generate([_prompt(*case) for case in cases], _params(), use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


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
        assert mrope is not None
        assert np.array_equal(mrope.array(), want[:, 0].numpy())
        assert mrope.delta == int(delta)
        # A range past the prompt: the text position plus the delta on every axis.
        tail = mrope.for_range(len(ids) - 2, len(ids) + 3)
        assert np.array_equal(tail[:, :2], want[:, 0, -2:].numpy())
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
    llm, got = _generate(CASES, **SETTINGS[setting])
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{setting}: case {i} differs"
    if setting.startswith("preempt"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the setting did not force preemption"
    if setting == "preempt_swap":
        assert llm.llm_engine.scheduler.num_swap_outs > 0, "preemption fell back to recompute"
    assert encoder_stats(llm)["num_encoded"] == sum(len(imgs) for _, imgs in CASES)
    assert_released(llm)


def test_answers_depend_on_the_image_and_on_its_grid(expected: list[list[int]]) -> None:
    # Not a model that ignores its images: every case answers differently.
    assert len({tuple(e) for e in expected}) == len(expected)


def test_different_images_behind_the_same_text_get_their_own_answers(
    ref: Reference, expected: list[list[int]]
) -> None:
    llm = LLM(MODEL, enable_prefix_caching=True, max_num_seqs=1)
    # Two images of one size (one grid: the same placeholder ids and positions), then the
    # first again: each gets its own answer, and the repeat hits the cache.
    cases = [(ONE, [IMAGES[0]]), (ONE, [image(7, 56, 84)]), (ONE, [IMAGES[0]])]
    got = [
        list(llm.generate(_prompt(*case), _params(), use_tqdm=False)[0].outputs[0].token_ids)
        for case in cases
    ]
    assert got[0] == expected[0] and got[2] == expected[0]
    assert got[1] == ref.generate(*cases[1]) != got[0]
    assert llm.llm_engine.block_manager.prefix_hits > 0
    assert_released(llm)


def test_same_image_twice_hits_the_prefix_cache(expected: list[list[int]]) -> None:
    llm = LLM(MODEL, enable_prefix_caching=True, max_num_seqs=1)
    text, images = CASES[2]
    first = llm.generate(_prompt(text, images), _params(), use_tqdm=False)[0]
    assert llm.llm_engine.block_manager.prefix_hits == 0
    again = _prompt(text, [im.copy() for im in images])
    second = llm.generate(again, _params(), use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids) == expected[2]
    assert llm.llm_engine.block_manager.prefix_hits > 0
    # Both images' tokens were cached: the second request never ran the vision tower.
    assert second.num_cached_tokens > max(f.end for f in features(llm, again))
    assert encoder_stats(llm)["num_encoded"] == len(images)
    assert_released(llm)


def test_prompt_token_ids_and_chat(ref: Reference, expected: list[list[int]]) -> None:
    llm = LLM(MODEL)
    text, images = CASES[2]
    ids = llm.get_tokenizer().encode(text)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, _params(),
                       use_tqdm=False)[0]  # fmt: skip
    assert list(out.outputs[0].token_ids) == expected[2]
    # Chat content parts: each image part becomes <|vision_start|><|image_pad|><|vision_end|>.
    message = {"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGES[0]},
                                           {"type": "text", "text": "What is it?"}]}  # fmt: skip
    chat = llm.chat([message], _params(), use_tqdm=False)[0]
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
        llm.generate({"prompt": ONE, "multi_modal_data": {"video": [IMAGES[0]]}}, _params())
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
    cases = [CASES[1], CASES[2]]
    _, got = _generate(cases, model=str(path), max_num_batched_tokens=12)
    assert got == [reference.generate(*case) for case in cases]


def test_lora_on_the_language_model_equals_hf_peft(ref: Reference, tmp_path: Path) -> None:
    # The adapter targets the language model's layers only (the tower has no q/v_proj, but a
    # down_proj: the pattern keeps it out).
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)",
        init_lora_weights=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        base = type(ref.model).from_pretrained(ref.path, dtype=torch.float32)
        peft = get_peft_model(base, config)
    peft.save_pretrained(str(tmp_path))
    text, images = CASES[2]
    inputs = ref.inputs(text, images)
    with torch.no_grad():
        out = peft.eval().generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    expected_lora = out[0, inputs["input_ids"].shape[1] :].tolist()
    llm = LLM(MODEL, enable_lora=True, max_lora_rank=8)
    prompt = _prompt(text, images)
    got = llm.generate(
        [prompt, prompt], _params(), lora_request=[LoRARequest("a", 1, str(tmp_path)), None],
        use_tqdm=False,
    )  # fmt: skip
    assert list(got[0].outputs[0].token_ids) == expected_lora
    assert list(got[1].outputs[0].token_ids) == ref.generate(text, images) != expected_lora
