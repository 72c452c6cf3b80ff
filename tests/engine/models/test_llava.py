"""LLaVA (``builtin:tiny-llava``): greedy output equals HF's ``LlavaForConditionalGeneration``
with HF's ``LlavaProcessor`` on the same images, token for token (fp32), with one and two images
per prompt at different sizes, under chunked prefill that splits an image's tokens, preemption
and prefix caching, and under a LoRA adapter on the language model (HF + PEFT); each image is
encoded once per request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlavaForConditionalGeneration

from engine import LLM
from engine.builtin.tiny_vlm_models import make_tiny_llava
from tests.engine.vlm_checks import (
    Reference,
    assert_lora_equals_peft,
    assert_own_answers_behind_the_same_text,
    assert_released,
    assert_same_images_twice_hit_the_prefix_cache,
    assert_setting_kept_hf_tokens,
    cases,
    encoder_stats,
    generate,
    greedy,
    hf_greedy,
    language_model_lora,
    mm_prompt,
    seeded_images,
)

MODEL = "builtin:tiny-llava"
MAX_TOKENS = 24
TOKENS_PER_IMAGE = 36  # (48 / 8)^2 patches; the class token is dropped
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image> and then <image>\nCompare the two. ASSISTANT:"


# Sizes on both sides of the processor's 48x48: each is resized and centre-cropped.
SIZES = [(40, 70), (96, 64), (48, 48), (200, 120), (33, 33), (64, 150)]
IMAGES = seeded_images(SIZES)
CASES = cases(ONE, TWO, IMAGES, ((0,), (1,), (2, 3), (4, 5)))


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference("tiny-llava", LlavaForConditionalGeneration, MAX_TOKENS)


SETTINGS = {
    "defaults": {},
    # 16-token chunks: each image's 36 tokens span three or four steps.
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preempt_recompute": {"num_kv_blocks": 14, "preemption_mode": "recompute"},
    "preempt_swap": {"num_kv_blocks": 14, "preemption_mode": "swap", "swap_space": 0.05},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(expected: list[list[int]], setting: str) -> None:
    llm, got = generate(MODEL, CASES, MAX_TOKENS, **SETTINGS[setting])
    assert_setting_kept_hf_tokens(llm, setting, got, expected, CASES)


def test_different_images_behind_the_same_text_get_their_own_answers(
    ref: Reference, expected: list[list[int]]
) -> None:
    # Cases 0 and 1: the same text (the same placeholder ids), two images.
    assert_own_answers_behind_the_same_text(MODEL, CASES[:2], expected[:2])


def test_same_image_twice_hits_the_prefix_cache(expected: list[list[int]]) -> None:
    assert_same_images_twice_hit_the_prefix_cache(MODEL, CASES[2], expected[2])


def test_prompt_token_ids_with_one_placeholder_per_image(expected: list[list[int]]) -> None:
    llm = LLM(MODEL)
    text, images = CASES[2]
    ids = llm.get_tokenizer().encode(text)
    out = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
        greedy(MAX_TOKENS),
        use_tqdm=False,
    )[0]
    assert list(out.outputs[0].token_ids) == expected[2]
    assert len(out.prompt_token_ids) == len(ids) + 2 * (TOKENS_PER_IMAGE - 1)


def test_one_image_in_two_live_requests_is_encoded_once(
    ref: Reference, expected: list[list[int]]
) -> None:
    # The encoder cache is keyed by the image's content: the second request reuses the
    # first's embeddings while both run (prefix caching off, so nothing else is shared).
    cases = [CASES[0], (TWO, [IMAGES[0], IMAGES[0]])]
    llm, got = generate(MODEL, cases, MAX_TOKENS, enable_prefix_caching=False)
    assert got == [expected[0], ref.generate(*cases[1])]
    assert encoder_stats(llm)["num_encoded"] == 1
    assert_released(llm)


def test_lora_on_the_language_model_equals_hf_peft(ref: Reference, tmp_path: Path) -> None:
    # PEFT names the language model's layers model.language_model.layers.N: the adapter
    # targets them only (the tower's q/v projections have the same names).
    peft = language_model_lora(LlavaForConditionalGeneration, ref.path, tmp_path)
    text, images = CASES[2]
    inputs = ref.processor(text=text, images=images, return_tensors="pt")
    expected_lora = hf_greedy(peft, inputs, MAX_TOKENS)
    assert_lora_equals_peft(MODEL, CASES[2], tmp_path, expected_lora, ref.generate(text, images))


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
    reference = Reference(path, LlavaForConditionalGeneration, MAX_TOKENS)
    llm = LLM(str(path), max_num_batched_tokens=20)
    answers = []
    for text, images in CASES[1:3]:
        expected = reference.generate(text, images)
        got = llm.generate(mm_prompt(text, images), greedy(MAX_TOKENS), use_tqdm=False)[0]
        assert list(got.outputs[0].token_ids) == expected
        assert len(got.prompt_token_ids) == len(reference.input_ids(text, images))
        answers.append(expected)
    assert answers[0] != answers[1] and len(set(answers[0])) > MAX_TOKENS // 2
