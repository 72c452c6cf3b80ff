"""The FP8 KV cache's and the quantized GEMMs' Triton kernels compile ahead of time for sm_90
(H100/H200) and, where they are meant to run there too, sm_80 (A100), with the arguments their
wrappers launch them with; no GPU needed (tests/llm_kernels/triton_aot.py).

Under the interpreter the FP8 GEMM wrapper passes FP8 operands as bytes and decodes them in
the kernel (``NATIVE=False``); a GPU launch passes them as float8 and uses FP8 tensor-core
dots, so the recorded launch is turned into that one before compiling (sm_90 only: FP8
``tl.dot`` needs sm_89+)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="the AOT compile checks need the triton package")

from llm_kernels import triton_attention, triton_cache, triton_common, triton_quant_gemm
from llm_kernels.kv_quant import FP8_DTYPE
from llm_kernels.quant_gemm import pack_int4
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

MODULES = (triton_attention, triton_cache, triton_quant_gemm)


@pytest.fixture
def compile_launches(monkeypatch: pytest.MonkeyPatch, aot_compiler: AotCompiler) -> Callable:
    def run(call: Callable[[], object], arch: int = SM90) -> list[str]:
        names = []
        for launch in record_launches(monkeypatch, MODULES, call):
            answer = aot_compiler.compile(compile_job(as_on_gpu(launch), arch))
            if "error" in answer:
                pytest.fail(f"{launch.kernel} does not compile for sm_{arch}:\n{answer['error']}")
            assert answer["cubin_size"] > 0
            assert answer["shared"] <= MAX_SHARED_BYTES[arch]
            names.append(launch.kernel)
        return names

    return run


def as_on_gpu(launch: Launch) -> Launch:
    args: dict[str, Any] = launch.args
    for flag in ("DOT_UPCAST", "UPCAST"):
        if flag in args:
            args[flag] = False
    if args.get("NATIVE") is False:
        args["NATIVE"] = True
        args["x_ptr"] = args["x_ptr"].view(FP8_DTYPE)
        args["w_ptr"] = args["w_ptr"].view(FP8_DTYPE)
        launch.options["num_stages"] = 3
    return launch


def device() -> str:
    return "cpu" if triton_common.interpreter_enabled() else "cuda"


def fp8_cache_batch(query_lens, dtype=torch.bfloat16):
    query, kv, meta = paged_batch(
        query_lens, [35, 60][: len(query_lens)], num_heads=32, num_kv_heads=8, head_dim=128,
        dtype=dtype, device=device(),
    )  # fmt: skip
    return query, kv.to(FP8_DTYPE), meta


@pytest.mark.parametrize("arch", [SM90, SM80])
@pytest.mark.parametrize("query_lens", [[1], [1, 40]], ids=["decode", "mixed"])
def test_fp8_cache_attention_compiles(compile_launches, query_lens, arch):
    query, kv, meta = fp8_cache_batch(query_lens)
    names = compile_launches(
        lambda: triton_attention.paged_attention(query, kv, meta, 0.1, k_scale=0.5, v_scale=2.0),
        arch,
    )
    assert names == ["_paged_attention_kernel"]


def test_fp8_cache_write_compiles(compile_launches):
    kv = torch.zeros(2, 4, 16, 8, 128, dtype=FP8_DTYPE, device=device())
    key, value = (torch.zeros(3, 8, 128, dtype=torch.bfloat16, device=device()) for _ in "kv")
    slots = torch.tensor([0, 17, -1], device=device())
    names = compile_launches(
        lambda: triton_cache.reshape_and_cache(key, value, kv, slots, k_scale=0.5, v_scale=0.1)
    )
    assert names == ["_reshape_and_cache_kernel"]


@pytest.mark.parametrize("m", [4, 256])
def test_fp8_block_gemm_compiles_for_sm90(compile_launches, m):
    x = torch.zeros(m, 1024, dtype=torch.bfloat16, device=device())
    w = torch.zeros(512, 1024, dtype=FP8_DTYPE, device=device())
    scale = torch.ones(4, 8, device=device())
    names = compile_launches(
        lambda: triton_quant_gemm.fp8_block_linear(x, w, scale, (128, 128), None, torch.bfloat16)
    )
    assert names == ["_fp8_block_gemm_kernel"]


@pytest.mark.parametrize("arch", [SM90, SM80])
@pytest.mark.parametrize("m", [4, 256])
def test_w4a16_gemm_compiles(compile_launches, m, arch):
    x = torch.zeros(m, 1024, dtype=torch.bfloat16, device=device())
    packed = pack_int4(torch.zeros(512, 1024, dtype=torch.int8)).to(device())
    scale = torch.ones(512, 8, dtype=torch.bfloat16, device=device())
    zero = torch.zeros(512, 8, dtype=torch.int8, device=device())
    names = compile_launches(
        lambda: triton_quant_gemm.w4a16_gemm(x, packed, scale, zero, 128, None), arch
    )
    assert names == ["_w4a16_gemm_kernel"]
