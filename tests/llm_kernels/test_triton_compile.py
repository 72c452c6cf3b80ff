"""Every Triton kernel compiles ahead of time for sm_90 (H100/H200), and the attention prefill
for sm_80 (A100), with exactly the arguments and constexprs its wrapper launches it with; no GPU
needed.

The other kernel tests run on CPU through the Triton interpreter, which executes kernels as
Python and accepts code the real compiler rejects. Here each test calls a public wrapper on
small tensors with its kernels' launches recorded instead of run, so block sizes, paddings,
split counts, ``num_warps`` and argument types all come from the wrapper, then compiles every
recorded launch to PTX and a cubin (tests/llm_kernels/triton_aot.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="the AOT compile checks need the triton package")

from llm_kernels import triton_attention, triton_cache, triton_common, triton_ops
from tests.llm_kernels.triton_aot import (
    MAX_SHARED_BYTES,
    SM80,
    SM90,
    AotCompiler,
    Launch,
    compile_job,
    record_launches,
)
from tests.llm_kernels.triton_batches import paged_batch

KERNEL_MODULES = (triton_attention, triton_cache, triton_ops)


@pytest.fixture
def compile_launches(
    monkeypatch: pytest.MonkeyPatch, aot_compiler: AotCompiler
) -> Callable[..., list[tuple[str, dict[str, Any]]]]:
    """Records the launches of a wrapper call and compiles each for ``sm_<arch>``; fails on the
    first compile error, with the compiler's message."""

    def run(call: Callable[[], object], arch: int = SM90) -> list[tuple[str, dict[str, Any]]]:
        results = []
        for launch in record_launches(monkeypatch, KERNEL_MODULES, call):
            answer = aot_compiler.compile(compile_job(as_on_gpu(launch), arch))
            if "error" in answer:
                pytest.fail(f"{launch.kernel} does not compile for sm_{arch}:\n{answer['error']}")
            assert f".target sm_{arch}" in answer["ptx"]
            assert answer["cubin_size"] > 0
            assert answer["shared"] <= MAX_SHARED_BYTES[arch]
            results.append((launch.kernel, answer))
        return results

    return run


def as_on_gpu(launch: Launch) -> Launch:
    """Under the interpreter the attention wrapper upcasts bf16 ``tl.dot`` operands (see
    llm_kernels/triton_attention.py); a compiled launch never does."""
    if "DOT_UPCAST" in launch.args:
        launch.args["DOT_UPCAST"] = False
    return launch


def device() -> str:
    """Where the wrappers accept tensors: CPU under the interpreter, else CUDA."""
    return "cpu" if triton_common.interpreter_enabled() else "cuda"


def kernel_names(results: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in results]


# (query_lens, dtype, head_dim, block_size, num_heads, num_kv_heads): decode-only batches (one
# request, so num_seqs is specialized to the constant 1) and mixed decode + prefill batches;
# every dtype, head dims 64 to 256, both block sizes, 1 to 32 query heads per kv head. fp32 runs
# decode only: its prefill tile (an FMA dot, no tensor cores) spills some 8 KB a thread, and
# ptxas takes from tens of seconds to minutes over it.
DECODE, MIXED = [1], [1, 40]
ATTENTION_CASES = [
    pytest.param(DECODE, torch.float16, 128, 16, 32, 8, id="decode-fp16-d128-gqa4"),
    pytest.param(MIXED, torch.bfloat16, 128, 16, 32, 8, id="mixed-bf16-d128-gqa4"),
    pytest.param(DECODE, torch.bfloat16, 64, 32, 16, 16, id="decode-bf16-d64-bs32-mha"),
    pytest.param(MIXED, torch.float16, 80, 32, 32, 32, id="mixed-fp16-d80-bs32-mha"),
    pytest.param(DECODE, torch.float32, 96, 16, 8, 1, id="decode-fp32-d96-mqa8"),
    pytest.param(MIXED, torch.bfloat16, 256, 16, 16, 1, id="mixed-bf16-d256-mqa16"),
    pytest.param(DECODE, torch.float16, 128, 16, 32, 1, id="decode-fp16-d128-mqa32"),
]


@pytest.mark.parametrize(
    ("query_lens", "dtype", "head_dim", "block_size", "num_heads", "num_kv_heads"),
    ATTENTION_CASES,
)
def test_paged_attention_compiles_for_sm90(
    compile_launches, query_lens, dtype, head_dim, block_size, num_heads, num_kv_heads
):
    batch = paged_batch(
        query_lens,
        [35, 60][: len(query_lens)],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device(),
    )
    results = compile_launches(lambda: triton_attention.paged_attention(*batch, 0.1))
    assert kernel_names(results) == ["_paged_attention_kernel"]


@pytest.mark.parametrize(
    ("query_lens", "num_kv_splits"),
    [(DECODE, None), (MIXED, None), ([1, 1], 4)],
    ids=["decode", "mixed", "split-kv"],
)
def test_windowed_soft_capped_attention_compiles_for_sm90(
    compile_launches, query_lens, num_kv_splits
):
    # Gemma 2's shapes: head_dim 256, 2 query heads per kv head.
    batch = paged_batch(
        query_lens,
        [900, 300][: len(query_lens)],
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        dtype=torch.bfloat16,
        device=device(),
    )
    results = compile_launches(
        lambda: triton_attention.paged_attention(
            *batch, 0.0625, sliding_window=256, logits_soft_cap=50.0, num_kv_splits=num_kv_splits
        )
    )
    merge = ["merge_splits_kernel"] if num_kv_splits else []
    assert kernel_names(results) == ["_paged_attention_kernel", *merge]


def test_split_kv_attention_and_its_merge_compile_for_sm90(compile_launches):
    batch = paged_batch(
        [1, 1],
        [900, 300],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device=device(),
    )
    results = compile_launches(
        lambda: triton_attention.paged_attention(*batch, 0.1, num_kv_splits=4)
    )
    assert kernel_names(results) == ["_paged_attention_kernel", "merge_splits_kernel"]


@pytest.mark.parametrize(
    ("query_lens", "window", "num_kv_splits"),
    [(DECODE, 128, None), (MIXED, None, None), ([1, 1], 128, 4)],
    ids=["decode-window", "mixed-full", "split-kv-window"],
)
def test_attention_with_sinks_compiles_for_sm90(
    compile_launches, query_lens, window, num_kv_splits
):
    # gpt-oss's heads (head_dim 64, 8 query heads per kv head), windowed and full layers.
    batch = paged_batch(
        query_lens,
        [900, 300][: len(query_lens)],
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        dtype=torch.bfloat16,
        device=device(),
    )
    sinks = torch.zeros(64, device=device())
    results = compile_launches(
        lambda: triton_attention.paged_attention(
            *batch, 0.125, sliding_window=window, sinks=sinks, num_kv_splits=num_kv_splits
        )
    )
    merge = ["merge_splits_kernel"] if num_kv_splits else []
    assert kernel_names(results) == ["_paged_attention_kernel", *merge]


def test_paged_attention_prefill_compiles_for_sm80(compile_launches):
    # Ampere lowers tl.dot to mma.sync where Hopper uses wgmma: a different path to PTX.
    batch = paged_batch(
        [1, 40],
        [35, 60],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device=device(),
    )
    results = compile_launches(lambda: triton_attention.paged_attention(*batch, 0.1), SM80)
    assert kernel_names(results) == ["_paged_attention_kernel"]


@pytest.mark.parametrize(("dtype", "num_kv_heads"), [(torch.bfloat16, 8), (torch.float32, 1)])
def test_reshape_and_cache_compiles_for_sm90(compile_launches, dtype, num_kv_heads):
    kv_cache = torch.zeros(2, 4, 16, num_kv_heads, 128, dtype=dtype, device=device())
    key, value = (torch.zeros(3, num_kv_heads, 128, dtype=dtype, device=device()) for _ in "kv")
    slots = torch.tensor([0, 17, -1], device=device())
    results = compile_launches(lambda: triton_cache.reshape_and_cache(key, value, kv_cache, slots))
    assert kernel_names(results) == ["_reshape_and_cache_kernel"]


def test_copy_blocks_compiles_for_sm90(compile_launches):
    kv_cache = torch.zeros(2, 4, 16, 8, 128, dtype=torch.float16, device=device())
    mapping = torch.tensor([[0, 2], [1, 3]], device=device())
    results = compile_launches(lambda: triton_cache.copy_blocks([kv_cache], mapping))
    assert kernel_names(results) == ["_copy_blocks_kernel"]


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_compiles_for_sm90(compile_launches, with_residual):
    x = torch.zeros(4, 4096, dtype=torch.bfloat16, device=device())
    weight = torch.ones(4096, dtype=torch.bfloat16, device=device())
    residual = torch.zeros_like(x) if with_residual else None
    results = compile_launches(lambda: triton_ops.rms_norm(x, weight, 1e-5, residual))
    assert kernel_names(results) == ["_rms_norm_kernel"]


def test_rotary_embedding_compiles_for_sm90(compile_launches):
    qkv = torch.zeros(4, 48, 128, dtype=torch.bfloat16, device=device())
    cos = sin = torch.zeros(64, 128, device=device())
    positions = torch.arange(4, device=device())
    results = compile_launches(
        # A single kv head, as in MQA: the launch specializes num_heads to the constant 1.
        lambda: triton_ops.rotary_embedding(positions, qkv[:, :32], qkv[:, 32:33], cos, sin)
    )
    assert kernel_names(results) == ["_rotary_kernel", "_rotary_kernel"]


def test_silu_and_mul_compiles_for_sm90(compile_launches):
    x = torch.zeros(4, 2 * 14336, dtype=torch.float16, device=device())
    results = compile_launches(lambda: triton_ops.silu_and_mul(x))
    assert kernel_names(results) == ["_act_and_mul_kernel"]


def test_gelu_tanh_and_mul_compiles_for_sm90(compile_launches):
    x = torch.zeros(4, 2 * 9216, dtype=torch.bfloat16, device=device())
    results = compile_launches(lambda: triton_ops.gelu_tanh_and_mul(x))
    assert kernel_names(results) == ["_act_and_mul_kernel"]
