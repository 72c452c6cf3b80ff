"""LLaVA (``builtin:tiny-llava``): greedy output equals HF's ``LlavaForConditionalGeneration``
with HF's ``LlavaProcessor`` on the same images, token for token (fp32), with one and two images
per prompt at different sizes, under chunked prefill that splits an image's tokens, preemption
and prefix caching, and under a LoRA adapter on the language model (HF + PEFT); each image is
encoded once per request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from engine import LLM, LoRARequest, SamplingParams
from engine.builtin.tiny_vlm_models import make_tiny_llava
from tests.engine.vlm_checks import (
    Reference,
    assert_released,
    encoder_stats,
    features,
    image,
)
from tests.engine.vlm_checks import generate as generate_with

MAX_TOKENS = 24
TOKENS_PER_IMAGE = 36  # (48 / 8)^2 patches; the class token is dropped
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image> and then <image>\nCompare the two. ASSISTANT:"


# Sizes on both sides of the processor's 48x48: each is resized and centre-cropped.
SIZES = [(40, 70), (96, 64), (48, 48), (200, 120), (33, 33), (64, 150)]
IMAGES = [image(i, h, w) for i, (h, w) in enumerate(SIZES)]
CASES: list[tuple[str, list[Image.Image]]] = [
    (ONE, [IMAGES[0]]),
    (ONE, [IMAGES[1]]),
    (TWO, [IMAGES[2], IMAGES[3]]),
    (TWO, [IMAGES[4], IMAGES[5]]),
]


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference("tiny-llava", LlavaForConditionalGeneration, MAX_TOKENS)


@pytest.fixture(scope="module")
def expected(ref: Reference) -> list[list[int]]:
    return [ref.generate(text, images) for text, images in CASES]


def _generate(cases: list[tuple[str, list[Image.Image]]], **engine_args: Any):
    return generate_with("builtin:tiny-llava", cases, MAX_TOKENS, **engine_args)


SETTINGS = {
    "defaults": {},
    # 16-token chunks: each image's 36 tokens span three or four steps.
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preempt_recompute": {"num_kv_blocks": 14, "preemption_mode": "recompute"},
    "preempt_swap": {"num_kv_blocks": 14, "preemption_mode": "swap", "swap_space": 0.05},
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
    # Once per image and request: not per chunk, not again after a preemption.
    assert encoder_stats(llm)["num_encoded"] == sum(len(imgs) for _, imgs in CASES)
    assert_released(llm)


def test_different_images_behind_the_same_text_get_their_own_answers(
    ref: Reference, expected: list[list[int]]
) -> None:
    # Cases 0 and 1: the same text (the same placeholder ids), two images. With prefix
    # caching the second must not reuse the first's blocks.
    llm = LLM("builtin:tiny-llava", enable_prefix_caching=True, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = []
    for text, images in CASES[:2]:
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        got.append(list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids))
    assert got == expected[:2]
    assert got[0] != got[1]
    assert_released(llm)


def test_same_image_twice_hits_the_prefix_cache(expected: list[list[int]]) -> None:
    llm = LLM("builtin:tiny-llava", enable_prefix_caching=True, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    text, images = CASES[2]
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.llm_engine.block_manager.prefix_hits == 0
    # The same image objects decoded again: the hash is of the content, not the object.
    again = {"prompt": text, "multi_modal_data": {"image": [im.copy() for im in images]}}
    second = llm.generate(again, params, use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids) == expected[2]
    assert llm.llm_engine.block_manager.prefix_hits > 0
    assert second.num_cached_tokens > 0
    # Both images' tokens were cached: the second request never ran the vision tower.
    assert second.num_cached_tokens > max(f.end for f in features(llm, prompt))
    assert encoder_stats(llm)["num_encoded"] == len(images)
    assert_released(llm)


def test_prompt_token_ids_with_one_placeholder_per_image(expected: list[list[int]]) -> None:
    llm = LLM("builtin:tiny-llava")
    text, images = CASES[2]
    ids = llm.get_tokenizer().encode(text)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, params, use_tqdm=False
    )[0]
    assert list(out.outputs[0].token_ids) == expected[2]
    assert len(out.prompt_token_ids) == len(ids) + 2 * (TOKENS_PER_IMAGE - 1)


def test_one_image_in_two_live_requests_is_encoded_once(
    ref: Reference, expected: list[list[int]]
) -> None:
    # The encoder cache is keyed by the image's content: the second request reuses the
    # first's embeddings while both run (prefix caching off, so nothing else is shared).
    cases = [CASES[0], (TWO, [IMAGES[0], IMAGES[0]])]
    llm, got = _generate(cases, enable_prefix_caching=False)
    assert got == [expected[0], ref.generate(*cases[1])]
    assert encoder_stats(llm)["num_encoded"] == 1
    assert_released(llm)


def test_lora_on_the_language_model_equals_hf_peft(ref: Reference, tmp_path: Path) -> None:
    # PEFT names the language model's layers model.language_model.layers.N: the adapter
    # targets them only (the tower's q/v projections have the same names).
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)",
        init_lora_weights=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        peft = get_peft_model(
            LlavaForConditionalGeneration.from_pretrained(ref.path, dtype=torch.float32), config
        )
    peft.save_pretrained(str(tmp_path))
    text, images = CASES[2]
    inputs = ref.processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = peft.eval().generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    expected_lora = out[0, inputs["input_ids"].shape[1] :].tolist()
    llm = LLM("builtin:tiny-llava", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    got = llm.generate(
        [prompt, prompt], params, lora_request=[LoRARequest("a", 1, str(tmp_path)), None],
        use_tqdm=False,
    )  # fmt: skip
    assert list(got[0].outputs[0].token_ids) == expected_lora
    assert list(got[1].outputs[0].token_ids) == ref.generate(text, images)
    assert expected_lora != ref.generate(text, images)


def test_full_strategy_last_layer_gelu_and_a_mistral_language_model(tmp_path: Path) -> None:
    # The class token kept (37 tokens an image), every tower layer read, GELU in the tower
    # and tanh-GELU in the projector, a Mistral with a sliding window shorter than the prompt.
    path = make_tiny_llava(
        tmp_path,
        seed=3,
        mistral=True,
        vision_overrides={"hidden_act": "gelu"},
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        projector_hidden_act="gelu_pytorch_tanh",
    )
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["sliding_window"] = 48
    (path / "config.json").write_text(json.dumps(config))
    processor = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), max_num_batched_tokens=20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    answers = []
    for text, images in CASES[1:3]:
        inputs = processor(text=text, images=images, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        got = llm.generate(prompt, params, use_tqdm=False)[0]
        assert list(got.outputs[0].token_ids) == expected
        assert len(got.prompt_token_ids) == inputs["input_ids"].shape[1]
        answers.append(expected)
    assert answers[0] != answers[1] and len(set(answers[0])) > MAX_TOKENS // 2
