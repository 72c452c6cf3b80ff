"""gpt-oss (``builtin:tiny-gpt-oss``: sinks, a window of 8 on alternating layers, yarn past 64
positions, biased router and experts, a SwiGLU clamp that bites): the MoE block equals HF's
``GptOssMLP`` on the same weights, and greedy decoding equals HF transformers' in fp32 on each
CPU attention backend, with prompts past the window chunked over several steps. The shared MoE
suites (tests/engine/models/test_moe.py, test_moe_parallel.py) run it too: chunked prefill,
preemption, prefix caching, TP 2 and EP 2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.models import get_model_class
from engine.worker.model_loader import iterate_checkpoint, load_weights
from llm_kernels.backend import get_kernel_ops, resolve_attention_backend
from parallel.state import ParallelContext
from tests.engine.models.test_correctness import _hf_greedy, checkpoint_without, greedy_against_hf

SOURCE = "builtin:tiny-gpt-oss"


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    path = resolve_model_source(SOURCE)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _engine_model() -> torch.nn.Module:
    path = resolve_model_source(SOURCE)
    hf = json.loads((path / "config.json").read_text())
    model = get_model_class(hf["architectures"][0])(hf, ParallelContext(), get_kernel_ops("torch"))
    load_weights(model, iterate_checkpoint(path, progress=False))
    return model


def test_moe_block_equals_hfs_on_the_same_weights(hf_model: torch.nn.Module) -> None:
    """Router (bias, top-k then softmax), expert biases, interleaved gate/up and the clamps:
    on inputs large enough that the clamps cut, the outputs agree to float32 rounding."""
    ours = _engine_model().model.layers["1"].mlp
    theirs = hf_model.model.layers[1].mlp
    x = 3 * torch.randn(64, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = theirs(x[None])
        got = ours(x)
        gate_up = x @ theirs.experts.gate_up_proj[0] + theirs.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > hf_model.config.swiglu_limit).float().mean() > 0.1, "no clamp bites"
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_equals_hf_on_each_cpu_attention_backend(
    hf_model: torch.nn.Module, backend: str
) -> None:
    if resolve_attention_backend("auto", "cpu") != "cpu" and backend == "cpu":
        pytest.skip("the native CPU decode kernel does not build here")
    rng = random.Random(5)
    # Past the window (8) and, with the completions, past yarn's 64 trained positions.
    prompts = [[rng.randrange(5, 1024) for _ in range(n)] for n in (3, 30, 75)]
    with torch.no_grad():
        expected = [_hf_greedy(hf_model, p, 24) for p in prompts]
    llm = LLM(SOURCE, dtype="float32", attention_backend=backend, max_num_batched_tokens=16,
              num_kv_blocks=64)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


@pytest.mark.parametrize(
    "fields",
    [
        # GptOssConfig alternates sliding and full layers (the engine once made all sliding).
        ("layer_types",),
        # ... rotates with yarn x32 over 4096 trained positions, theta 150000 (once plain rope).
        ("rope_parameters", "rope_scaling", "rope_theta"),
        # ... clamps the SwiGLU at 7.0 (once refused).
        ("swiglu_limit",),
    ],
)
def test_a_field_the_config_leaves_out_takes_gpt_oss_default(
    tmp_path: Path, fields: tuple[str, ...]
) -> None:
    path = checkpoint_without(tmp_path, "tiny-gpt-oss", fields, sliding_window=5)
    got, expected = greedy_against_hf(path, (9, 30), 16)
    assert got == expected
