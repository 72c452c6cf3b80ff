"""Helpers the vision-language model tests share: seeded random images and the test cases made
of them, HF's greedy reference (model + processor on the same images, and a PEFT LoRA adapter on
its language model), the engine's greedy tokens, the workers' encoder cache counters, the checks
that a setting (chunked prefill, preemption) kept HF's tokens and that a finished run released
every block, request state and encoder output, the prefix cache keyed by the image, and TP = 2
against TP = 1 with spawned ranks driving their workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor

from engine import LLM, LoRARequest, SamplingParams
from engine.builtin.catalog import resolve_model_source

Case = tuple[str, list[Image.Image]]


def image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def seeded_images(sizes: list[tuple[int, int]], first_seed: int = 0) -> list[Image.Image]:
    """One seeded image per ``(height, width)``, seeds counting up from ``first_seed``."""
    return [image(first_seed + i, h, w) for i, (h, w) in enumerate(sizes)]


def cases(
    one: str, two: str, imgs: list[Image.Image], picks: tuple[tuple[int, ...], ...]
) -> list[Case]:
    """A prompt with one image or two (``one``/``two``) per pick of indices into ``imgs``."""
    return [(one if len(pick) == 1 else two, [imgs[i] for i in pick]) for pick in picks]


def mm_prompt(text: str, imgs: list[Image.Image]) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": imgs}}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def hf_greedy(model: Any, inputs: Any, max_tokens: int) -> list[int]:
    """HF's greedy new tokens of ``model`` on processed ``inputs`` (one prompt)."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


class Reference:
    """HF's ``model_class`` and ``AutoProcessor`` of a checkpoint (a built-in's name or a
    path), greedy in fp32."""

    def __init__(self, source: str | Path, model_class: Any, max_tokens: int) -> None:
        self.path = resolve_model_source(f"builtin:{source}") if isinstance(source, str) else source
        self.processor = AutoProcessor.from_pretrained(self.path)
        self.model = model_class.from_pretrained(self.path, dtype=torch.float32).eval()
        self.max_tokens = max_tokens

    def input_ids(self, text: str, images: list[Image.Image]) -> list[int]:
        return self.processor(text=text, images=images, return_tensors="pt")["input_ids"][
            0
        ].tolist()

    def generate(self, text: str, images: list[Image.Image]) -> list[int]:
        inputs = self.processor(text=text, images=images, return_tensors="pt")
        return hf_greedy(self.model, inputs, self.max_tokens)


def language_model_lora(model_class: Any, path: Path, out: Path) -> Any:
    """HF's model at ``path`` under a seeded random rank-4 PEFT adapter on its language model's
    q/v/down projections (the pattern keeps the tower's like-named layers out), saved to
    ``out``; returns the PEFT model in eval mode."""
    from peft import LoraConfig, get_peft_model  # optional package, loaded by the LoRA tests only

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)",
        init_lora_weights=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        peft = get_peft_model(model_class.from_pretrained(path, dtype=torch.float32), config)
    peft.save_pretrained(str(out))
    return peft.eval()


def assert_lora_equals_peft(
    model: str, case: Case, adapter: Path, with_lora: list[int], without: list[int]
) -> None:
    """The engine (LoRA on) serves ``case`` twice in one batch, with the adapter and without:
    PEFT's tokens and the base model's, which differ."""
    llm = LLM(model, enable_lora=True, max_lora_rank=8)
    request = mm_prompt(*case)
    got = llm.generate(
        [request, request], greedy(len(with_lora)),
        lora_request=[LoRARequest("a", 1, str(adapter)), None], use_tqdm=False,
    )  # fmt: skip
    assert list(got[0].outputs[0].token_ids) == with_lora
    assert list(got[1].outputs[0].token_ids) == without != with_lora


def generate(
    model: str, cases: list[Case], max_tokens: int, **engine_args: Any
) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model, **engine_args)
    outputs = llm.generate([mm_prompt(*case) for case in cases], greedy(max_tokens), use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


def one_at_a_time(llm: LLM, cases: list[Case], max_tokens: int) -> list[list[int]]:
    """The greedy tokens of each case, each request finished before the next is sent."""
    params = greedy(max_tokens)
    return [
        list(llm.generate(mm_prompt(*case), params, use_tqdm=False)[0].outputs[0].token_ids)
        for case in cases
    ]


def features(llm: LLM, prompt: dict[str, Any]) -> list[Any]:
    """The ``MultiModalFeature``s the engine's input processing makes of ``prompt``."""
    ids = llm.get_tokenizer().encode(prompt["prompt"])
    return llm.llm_engine.inputs.process_multimodal(prompt, ids)[1]


def encoder_stats(llm: LLM) -> dict[str, int]:
    return llm.llm_engine.executor.collective_rpc("encoder_cache_stats")[0]


def assert_released(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    stats = engine.get_kv_cache_stats()
    assert stats.free == stats.total
    assert engine.executor.collective_rpc("num_request_states") == [0]
    assert encoder_stats(llm)["num_cached"] == 0, "encoder outputs outlived their requests"


def assert_setting_kept_hf_tokens(
    llm: LLM,
    setting: str,
    got: list[list[int]],
    expected: list[list[int]],
    cases: list[Case],
) -> None:
    """``got`` (``cases`` under ``setting``) equals HF's tokens case by case; a ``preempt*``
    setting did preempt (``preempt_swap``: by swapping); each image was encoded once per
    request (not per chunk, not again after a preemption); everything was released."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"{setting}: case {i} differs"
    if setting.startswith("preempt"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the setting did not force preemption"
    if setting == "preempt_swap":
        assert llm.llm_engine.scheduler.num_swap_outs > 0, "preemption fell back to recompute"
    assert encoder_stats(llm)["num_encoded"] == sum(len(imgs) for _, imgs in cases)
    assert_released(llm)


def assert_own_answers_behind_the_same_text(
    model: str, cases: list[Case], expected: list[list[int]]
) -> None:
    """``cases`` (one text, different images: the same placeholder ids) one after another
    with prefix caching: HF's tokens each, and different answers (no case reused another's
    blocks)."""
    llm = LLM(model, enable_prefix_caching=True, max_num_seqs=1)
    got = one_at_a_time(llm, cases, len(expected[0]))
    assert got == expected
    assert len({tuple(g) for g in got}) == len(got)
    assert_released(llm)


def assert_same_images_twice_hit_the_prefix_cache(
    model: str, case: Case, expected: list[int]
) -> None:
    """``case`` twice (its images copied: the hash is of the content, not the object) with
    prefix caching: HF's tokens both times, and the second request's cached prefix covers
    every image, so the vision tower never ran for it."""
    llm = LLM(model, enable_prefix_caching=True, max_num_seqs=1)
    text, imgs = case
    params = greedy(len(expected))
    first = llm.generate(mm_prompt(text, imgs), params, use_tqdm=False)[0]
    assert llm.llm_engine.block_manager.prefix_hits == 0
    again = mm_prompt(text, [im.copy() for im in imgs])
    second = llm.generate(again, params, use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids) == expected
    assert llm.llm_engine.block_manager.prefix_hits > 0
    assert second.num_cached_tokens > max(f.end for f in features(llm, again))
    assert encoder_stats(llm)["num_encoded"] == len(imgs)
    assert_released(llm)


def assert_tp2_equals_tp1(
    name: str, prompts: list[str], images: list[list[Image.Image]], steps: int
) -> None:
    """The built-in ``name`` at TP = 2 (CPU, gloo, spawned ranks driving their workers as the
    head would; an M-RoPE model's 3-D positions sent with each request) gives the offline
    engine's TP = 1 greedy tokens on both ranks."""
    from tests.engine.spawned_ranks import run_ranks

    llm = LLM(f"builtin:{name}", num_kv_blocks=64, max_model_len=256)
    requests = [mm_prompt(text, imgs) for text, imgs in zip(prompts, images)]
    outputs = llm.generate(requests, greedy(steps + 1), use_tqdm=False)
    tp1 = [list(o.outputs[0].token_ids) for o in outputs]
    results = run_ranks(_tp2_rank_main, 2, name, prompts, images, steps)
    assert results[0] == results[1] == tp1


def _tp2_rank_main(
    rank: int,
    ports: Any,
    results: Any,
    name: str,
    prompts: list[str],
    images: list[list[Image.Image]],
    steps: int,
) -> None:
    """One spawned rank: the prompts processed as the head does (with their M-RoPE positions
    where the model has them), then ``steps`` greedy steps of this rank's worker in the TP
    group."""
    try:
        from transformers import AutoTokenizer

        from engine.multimodal.mrope import mrope_positions
        from engine.multimodal.processor import MultiModalProcessor
        from tests.engine.spawned_ranks import greedy_steps, rank_config, workers_on_one_group

        config = rank_config(
            rank,
            model=str(resolve_model_source(f"builtin:{name}")),
            tensor_parallel_size=2,
            num_kv_blocks=64,
            max_model_len=256,
        )
        model = config.model
        tokenizer = AutoTokenizer.from_pretrained(model.model_path)
        processor = MultiModalProcessor(model.hf_config, model.model_path, {})
        ids, feats, positions = [], [], []
        for text, imgs in zip(prompts, images):
            prompt_ids, prompt_features = processor.process(tokenizer.encode(text), {"image": imgs})
            ids.append(prompt_ids)
            feats.append(prompt_features)
            if "mrope_section" in model.hf_config:
                merge = int(model.hf_config["vision_config"]["spatial_merge_size"])
                positions.append(mrope_positions(len(prompt_ids), prompt_features, merge))
        for _, worker in workers_on_one_group(rank, 2, ports, {name: config}):
            tokens = greedy_steps(
                worker, ids, steps, blocks_per_request=8, mm_features=feats,
                mrope=positions or None,
            )  # fmt: skip
            results.put((rank, tokens))
    except BaseException as exc:
        results.put((rank, repr(exc)))
