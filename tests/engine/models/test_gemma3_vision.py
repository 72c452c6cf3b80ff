"""Gemma 3 vision (``builtin:tiny-gemma3-vision``): greedy output equals HF's
``Gemma3ForConditionalGeneration`` with HF's ``Gemma3Processor`` on the same images, token for
token (fp32), with one and two images per prompt at different sizes, sliding-window layers
whose window (12) is shorter than an image (16 tokens), under chunked prefill with a small
budget (the image stays whole in one chunk, the text splits), preemption and prefix caching
(a hit that would end inside an image backs off before it). Start-up refuses what cannot be
served exactly: a budget below one image, chunked images, pan-and-scan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3ForConditionalGeneration

from engine import LLM
from engine.builtin.tiny_vlm_models import make_tiny_gemma3_vision
from engine.errors import ConfigError
from engine.multimodal.inputs import image_feature, stop_before_split_image, whole_image_prefix
from tests.engine.vlm_checks import (
    Reference,
    assert_own_answers_behind_the_same_text,
    assert_released,
    assert_same_images_twice_hit_the_prefix_cache,
    assert_setting_kept_hf_tokens,
    cases,
    features,
    generate,
    greedy,
    hf_greedy,
    mm_prompt,
    seeded_images,
)

MODEL = "builtin:tiny-gemma3-vision"
MAX_TOKENS = 24
TOKENS_PER_IMAGE = 16  # SigLIP's 8x8 patches average-pooled 2x2
ONE = "USER: <start_of_image> What is in the picture? ASSISTANT:"
TWO = "USER: <start_of_image> and then <start_of_image> Compare the two. ASSISTANT:"
# Sizes on both sides of the processor's 32x32 (each is resized to it).
SIZES = [(40, 70), (96, 64), (32, 32), (200, 120), (21, 33), (64, 150)]
IMAGES = seeded_images(SIZES)
CASES = cases(ONE, TWO, IMAGES, ((0,), (1,), (2, 3), (4, 5)))


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference("tiny-gemma3-vision", Gemma3ForConditionalGeneration, MAX_TOKENS)


def _record_chunks(llm: LLM) -> list[tuple[int, int, list[Any]]]:
    """Every scheduled chunk from now on: (start, end, the request's images)."""
    scheduler = llm.llm_engine.scheduler
    chunks: list[tuple[int, int, list[Any]]] = []
    schedule = scheduler.schedule

    def recording() -> Any:
        out = schedule()
        for rid, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            start = request.num_computed_tokens
            chunks.append((start, start + n, request.mm_features))
        return out

    scheduler.schedule = recording  # type: ignore[method-assign]
    return chunks


def test_prompt_ids_match_hf_processor(ref: Reference) -> None:
    llm = LLM(MODEL)
    for text, images in CASES:
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        ids = llm.get_tokenizer().encode(text)
        expanded, feats = llm.llm_engine.inputs.process_multimodal(prompt, ids)
        assert expanded == ref.input_ids(text, images)
        assert [f.length for f in feats] == [TOKENS_PER_IMAGE] * len(images)
        # An already expanded prompt is kept as it is.
        again = {"prompt_token_ids": expanded, "multi_modal_data": {"image": images}}
        assert llm.llm_engine.inputs.process_multimodal(again, expanded)[0] == expanded


def test_newlines_around_an_image_merge_as_hf_tokenizes_them(tmp_path: Path) -> None:
    # A tokenizer with tokens for runs of newlines (Gemma's): HF tokenizes the expanded text,
    # so the prompt's newlines next to a placeholder merge with the image's "\n\n".
    path = make_tiny_gemma3_vision(tmp_path, seed=1, newline_tokens=True)
    reference = Reference(path, Gemma3ForConditionalGeneration, MAX_TOKENS)
    processor = reference.processor
    llm = LLM(str(path))
    texts = [
        "USER:\n<start_of_image>\nWhat is it?",
        "A\n\n<start_of_image>\n\n\n<start_of_image>B",
        "<start_of_image>\n<start_of_image>\n",
    ]
    for text in texts:
        images = IMAGES[: text.count("<start_of_image>")]
        want = processor(text=text, images=images, return_tensors="pt")["input_ids"][0].tolist()
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        ids = llm.get_tokenizer().encode(text)
        got, feats = llm.llm_engine.inputs.process_multimodal(prompt, ids)
        assert got == want, text
        assert all(got[f.offset - 1] == processor.tokenizer.boi_token_id for f in feats)
    _, got_tokens = generate(str(path), [(texts[0], IMAGES[:1])], MAX_TOKENS)
    assert got_tokens == [reference.generate(texts[0], IMAGES[:1])]


SETTINGS = {
    "defaults": {},
    # 20-token chunks: a prompt's text splits, each image's 16 tokens stay in one chunk.
    "chunked_prefill": {"max_num_batched_tokens": 20, "max_num_seqs": 4},
    "preempt_recompute": {"num_kv_blocks": 12, "preemption_mode": "recompute"},
    "preempt_swap": {"num_kv_blocks": 12, "preemption_mode": "swap", "swap_space": 0.05},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(expected: list[list[int]], setting: str) -> None:
    llm = LLM(MODEL, **SETTINGS[setting])
    chunks = _record_chunks(llm)
    outputs = llm.generate([mm_prompt(*case) for case in CASES], greedy(MAX_TOKENS), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    # No chunk ever ends inside an image (nor starts inside one).
    for start, end, feats in chunks:
        for f in feats:
            assert not f.offset < end < f.end and not f.offset < start < f.end
    if setting == "chunked_prefill":
        prefill = [(s, e) for s, e, feats in chunks if feats and s < max(f.end for f in feats)]
        # The text split: some chunk stopped right before an image with budget left over.
        assert any(e - s < 20 and any(e == f.offset for f in feats) for s, e, feats in chunks)
        assert len(prefill) > len(CASES)
    assert_setting_kept_hf_tokens(llm, setting, got, expected, CASES)


def test_different_images_behind_the_same_text_get_their_own_answers(
    expected: list[list[int]],
) -> None:
    # Cases 0 and 1: the same text (the same placeholder ids), two images.
    assert_own_answers_behind_the_same_text(MODEL, CASES[:2], expected[:2])


def test_same_images_twice_hit_the_prefix_cache(expected: list[list[int]]) -> None:
    assert_same_images_twice_hit_the_prefix_cache(MODEL, CASES[2], expected[2])


def test_a_prefix_hit_ending_inside_an_image_backs_off(ref: Reference) -> None:
    # Same text and image up to just after the image, then different text: the shared full
    # blocks of 8 end inside the image's tokens, so the hit stops at the block before it.
    llm = LLM(MODEL, enable_prefix_caching=True, max_num_seqs=1, block_size=8)
    params = greedy(MAX_TOKENS)
    first_text, second_text = ONE, "USER: <start_of_image>!"
    img = [IMAGES[0]]
    second = mm_prompt(second_text, img)
    (feature,) = features(llm, second)
    assert feature.offset % 8 and (feature.end // 8) * 8 > feature.offset  # a block ends inside
    llm.generate(mm_prompt(first_text, img), params, use_tqdm=False)
    out = llm.generate(second, params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == ref.generate(second_text, img)
    assert 0 < out.num_cached_tokens == feature.offset - feature.offset % 8
    assert_released(llm)


def test_scheduling_helpers_keep_images_whole() -> None:
    feats = [image_feature(np.zeros((3, 2, 2), np.float32), o, 16) for o in (10, 30)]
    # A chunk that would end inside an image stops before it; one that ends outside runs.
    assert stop_before_split_image(feats, 0, 20) == 10
    assert stop_before_split_image(feats, 10, 20) == 20  # ends right before the second
    assert stop_before_split_image(feats, 10, 24) == 20
    assert stop_before_split_image(feats, 26, 10) == 4  # stops before the second image
    assert stop_before_split_image(feats, 0, 26) == 26
    # A cached prefix in whole blocks that ends outside every image.
    assert whole_image_prefix(feats, 50, 8) == 48
    assert whole_image_prefix(feats, 40, 8) == 8  # 40 in [30, 46) -> 24 in [10, 26) -> 8
    assert whole_image_prefix(feats, 29, 8) == 8  # 24 is inside the first image
    assert whole_image_prefix(feats, 33, 8) == 8
    assert whole_image_prefix(feats, 7, 8) == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"max_num_batched_tokens": 15}, "max_num_batched_tokens: must be >= 16"),
        ({"disable_chunked_mm_input": False}, "disable_chunked_mm_input: .* cannot be false"),
    ],
)
def test_refused_at_start_up(args: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(MODEL, **args)


def test_pan_and_scan_is_refused(ref: Reference, tmp_path: Path) -> None:
    path = tmp_path / "model"
    shutil.copytree(ref.path, path)
    config_file = path / "preprocessor_config.json"
    config = json.loads(config_file.read_text())
    config["do_pan_and_scan"] = True
    config_file.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="do_pan_and_scan"):
        LLM(str(path))


@pytest.mark.slow
def test_triton_backend_attends_image_chunks_on_the_torch_path(expected: list[list[int]]) -> None:
    # The Triton kernels are causal only: a step whose chunk holds an image takes the torch
    # path's masked prefill (here through the Triton interpreter on CPU; the gpu test below
    # on CUDA), every other step the kernels.
    _, got = generate(
        MODEL, CASES[:1] + CASES[2:3], MAX_TOKENS, attention_backend="triton", device="cpu"
    )
    assert got == [expected[0], expected[2]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_engine_matches_hf(expected: list[list[int]]) -> None:
    _, got = generate(
        MODEL, CASES, MAX_TOKENS, device="cuda", dtype="float32", max_num_batched_tokens=20
    )
    assert got == expected


def test_chat_with_an_image_part_equals_hf_on_the_rendered_prompt(ref: Reference) -> None:
    # The image part becomes <start_of_image> in the message; the template renders it, the
    # processor expands it (the template's <s> is the only BOS).
    llm = LLM(MODEL)
    content = [{"type": "image_pil", "image_pil": IMAGES[3]}, {"type": "text", "text": "What?"}]
    out = llm.chat([{"role": "user", "content": content}], greedy(MAX_TOKENS), use_tqdm=False)[0]
    text = ref.processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "<start_of_image>\nWhat?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = ref.processor(
        text=text, images=[IMAGES[3]], return_tensors="pt", add_special_tokens=False
    )
    assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == hf_greedy(ref.model, inputs, MAX_TOKENS)


def test_a_hub_layout_checkpoint_loads_the_same(
    ref: Reference, expected: list[list[int]], tmp_path: Path
) -> None:
    # transformers 4.x hub checkpoints: language_model.model.*, vision_tower.vision_model.*,
    # multi_modal_projector.* (transformers 5 saves model.language_model.* etc.).
    path = tmp_path / "hub"
    shutil.copytree(ref.path, path)
    tensors = load_file(str(path / "model.safetensors"))
    renames = (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    hub = {}
    for name, tensor in tensors.items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
        hub[name] = tensor
    assert not any(name.startswith("model.") for name in hub)
    save_file(hub, str(path / "model.safetensors"), metadata={"format": "pt"})
    _, got = generate(str(path), CASES[2:3], MAX_TOKENS)
    assert got == [expected[2]]


def test_a_tower_with_its_pooling_head_and_coarser_pooling_equals_hf(tmp_path: Path) -> None:
    # SigLIP's attention-pooling head in the checkpoint (never read: skipped), 4 tokens an
    # image (the 8x8 grid pooled 4x4), a window of 3 on the sliding layers.
    path = make_tiny_gemma3_vision(
        tmp_path,
        seed=2,
        vision_overrides={"vision_use_head": True},
        text_overrides={"sliding_window": 3},
        mm_tokens_per_image=4,
    )
    reference = Reference(path, Gemma3ForConditionalGeneration, MAX_TOKENS)
    assert any("head" in n for n, _ in reference.model.model.vision_tower.named_parameters())
    answers = [reference.generate(*case) for case in CASES[1:3]]
    _, got = generate(str(path), CASES[1:3], MAX_TOKENS, max_num_batched_tokens=8)
    assert got == answers
    assert answers[0] != answers[1]
