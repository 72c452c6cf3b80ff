"""HF transformers as ``cluster bench throughput``'s baselines, on the same weights and
workload as the engine: ``hf_static`` (``generate`` on fixed batches, left-padded) and
``hf_cb`` (transformers' own continuous batching, its KV cache sized to the workload).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from cluster.bench.workload import SystemResult, Workload


def load_hf(model_dir: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()


@torch.inference_mode()
def run_hf_static(model: Any, wl: Workload, batch_size: int) -> SystemResult:
    def generate(batch: list[int]) -> None:
        width = max(len(wl.prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):  # left padding, as generate expects for decoder-only models
            ids[row, width - len(wl.prompts[i]) :] = torch.tensor(wl.prompts[i])
            mask[row, width - len(wl.prompts[i]) :] = 1
        longest = max(wl.output_lens[i] for i in batch)
        model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=0,
        )

    generate([0, 1])  # warm-up
    order = list(range(len(wl.prompts)))
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        generate(order[first : first + batch_size])
    wall = time.perf_counter() - start
    return SystemResult(wall, wl.output_tokens, wl.total_tokens, len(wl.prompts))


@torch.inference_mode()
def run_hf_cb(model: Any, wl: Workload) -> SystemResult:
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max(wl.output_lens),
        eos_token_id=-1,
        pad_token_id=0,
    )
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # The KV cache sized to the workload (every request's whole sequence at once), as for the
    # engine; left unset, HF sizes it from free memory, and on CPU its first step then takes
    # ~20 s whatever the workload.
    page = 256
    pages = sum(-(-(len(p) + n) // page) for p, n in zip(wl.prompts, wl.output_lens))
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=pages + len(wl.prompts) + 1,
        max_batch_tokens=max(256, sum(len(p) for p in wl.prompts)),  # every prefill at once
    )
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=cb
    )
    manager.start()
    try:
        _drain(manager, [manager.add_request(wl.prompts[0], max_new_tokens=2)])  # warm-up
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(wl.prompts, wl.output_lens)]
        results = _drain(manager, ids)
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    produced = sum(len(r.generated_tokens) for r in results)
    if produced != wl.output_tokens:
        raise RuntimeError(f"hf_cb produced {produced} tokens, expected {wl.output_tokens}")
    return SystemResult(wall, wl.output_tokens, wl.total_tokens, len(wl.prompts))


def _drain(manager: Any, ids: list[str], timeout_s: float = 3600) -> list[Any]:
    pending, results = set(ids), []
    deadline = time.monotonic() + timeout_s
    while pending:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"hf_cb: {len(pending)} requests unfinished")
            continue
        if result.request_id in pending:
            pending.discard(result.request_id)
            results.append(result)
    return results
