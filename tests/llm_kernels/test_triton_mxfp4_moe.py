"""The MXFP4 fused MoE (gpt-oss's experts; the Triton kernel through the interpreter without
CUDA) against the torch path, which dequantizes each expert exactly as the CPU loader does,
and that path against a per-token loop over the loader's dense weights: float32 and bfloat16,
decode and uneven prefill, top-k 2 and 4, the clamps biting, no biases, expert parallelism,
and a TP rank's slice whose intermediate inputs start inside a 32-value group; and the kernel
compiled ahead of time for sm_90 at gpt-oss-120b's shapes."""

from __future__ import annotations

import pytest
import torch

from llm_kernels import triton_mxfp4_moe
from llm_kernels.moe import clamped_swiglu_interleaved, fused_moe_mxfp4
from llm_kernels.moe_inputs import Mxfp4Experts
from llm_kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from llm_kernels.triton_common import interpreter_enabled
from tests.llm_kernels.triton_aot import AotCompiler, compile_job, record_launches

ALPHA, LIMIT = 1.702, 7.0
HIDDEN = 64
# bf16: the torch path rounds h, the activation and y to bf16 as HF does, the kernel keeps
# float32 until it stores the activation; each is within this fraction of the output's
# largest magnitude of the float32 result on the same (bf16-exact) weights and inputs.
BF16_TOLERANCE = 1e-2


def _experts(
    num_experts: int, inter: int, dtype: torch.dtype, bias: bool = True, seed: int = 0
) -> Mxfp4Experts:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, inter, generator=g) / inter**0.5
    b13 = torch.randn(num_experts, 2 * inter, generator=g).to(dtype) if bias else None
    b2 = torch.randn(num_experts, HIDDEN, generator=g).to(dtype) if bias else None
    return Mxfp4Experts(*quantize_mxfp4(w13), b13, *quantize_mxfp4(w2), b2)


def _routing(num_tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's: the top-k logits, softmaxed over those k."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(7))
    values, ids = torch.topk(logits, top_k, dim=-1)
    return values.softmax(dim=-1), ids


def _x(num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    # Large enough that gate / up pass the clamp limit for a good share of the pairs.
    return (6 * torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(3))).to(
        dtype
    )


def _naive(
    x: torch.Tensor, experts: Mxfp4Experts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Token by token over the whole dense weights (``dequantize_mxfp4``, the loader's)."""
    w13 = dequantize_mxfp4(experts.w13_blocks, experts.w13_scales, x.dtype)
    w2 = dequantize_mxfp4(experts.w2_blocks, experts.w2_scales, x.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ x[t] + experts.w13_bias[e]
            y = w2[e] @ clamped_swiglu_interleaved(h, ALPHA, LIMIT) + experts.w2_bias[e]
            out[t] += weights[t, k] * y.float()
    return out.to(x.dtype)


def _run(backend: str, x: torch.Tensor, experts: Mxfp4Experts, *routing, **kwargs):
    return fused_moe_mxfp4(
        x, experts, *routing, alpha=ALPHA, limit=LIMIT, backend=backend, **kwargs
    )


def test_the_torch_path_equals_a_per_token_loop_over_the_loaders_weights() -> None:
    experts = _experts(8, 64, torch.float32)
    x = _x(9, torch.float32)
    routing = _routing(9, 8, 2)
    torch.testing.assert_close(
        _run("torch", x, experts, *routing), _naive(x, experts, *routing), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 4), (37, 2), (70, 4)])
def test_triton_equals_torch(dtype: torch.dtype, num_tokens: int, top_k: int) -> None:
    experts = _experts(8, 64, dtype)
    x = _x(num_tokens, dtype)
    routing = _routing(num_tokens, 8, top_k)
    want = _run("torch", x, experts, *routing)
    got = _run("triton", x, experts, *routing)
    assert got.dtype == dtype
    if dtype == torch.float32:  # ieee dots: only the order of the sums differs
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    as_fp32 = Mxfp4Experts(
        **{k: v.float() if k.endswith("bias") else v for k, v in vars(experts).items()}
    )
    exact = _run("torch", x.float(), as_fp32, *routing)
    atol = BF16_TOLERANCE * float(exact.abs().max())
    for result in (got, want):
        torch.testing.assert_close(result.float(), exact, rtol=0, atol=atol)


def test_the_clamps_bite_in_these_cases() -> None:
    experts = _experts(8, 64, torch.float32)
    w13 = dequantize_mxfp4(experts.w13_blocks, experts.w13_scales, torch.float32)
    h = torch.einsum("th,eih->tei", _x(37, torch.float32), w13) + experts.w13_bias
    assert (h.abs() > LIMIT).float().mean() > 0.1


def test_experts_without_biases() -> None:
    experts = _experts(8, 64, torch.float32, bias=False)
    x = _x(20, torch.float32)
    routing = _routing(20, 8, 2)
    torch.testing.assert_close(
        _run("triton", x, experts, *routing), _run("torch", x, experts, *routing),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip


def test_expert_parallel_ranks_sum_to_the_whole() -> None:
    """Two EP ranks holding experts 0-3 and 4-7, through ``expert_map``: their outputs add
    up to one rank holding all eight."""
    whole = _experts(8, 64, torch.float32)
    x = _x(25, torch.float32)
    routing = _routing(25, 8, 2)
    total = torch.zeros(25, HIDDEN)
    for rank in range(2):
        experts = Mxfp4Experts(
            **{k: v[4 * rank : 4 * rank + 4] for k, v in vars(whole).items() if k != "w2_offset"}
        )
        ids = torch.arange(8) - 4 * rank
        expert_map = torch.where((ids >= 0) & (ids < 4), ids, -1).to(torch.int32)
        got = _run("triton", x, experts, *routing, expert_map=expert_map)
        torch.testing.assert_close(
            got, _run("torch", x, experts, *routing, expert_map=expert_map), rtol=1e-5, atol=1e-5
        )
        total += got
    torch.testing.assert_close(total, _run("torch", x, whole, *routing), rtol=1e-5, atol=1e-5)


def _tp_slice(whole: Mxfp4Experts, rank: int, size: int) -> Mxfp4Experts:
    """Rank ``rank`` of ``size``: its run of interleaved w13 rows, the w2 groups covering its
    inputs, the offset of its first input in them; the down bias on rank 0 only."""
    inter = whole.intermediate // size
    start, end = rank * inter, (rank + 1) * inter
    first, last = start // 32, -(-end // 32)
    rows = slice(2 * start, 2 * end)
    return Mxfp4Experts(
        whole.w13_blocks[:, rows],
        whole.w13_scales[:, rows],
        whole.w13_bias[:, rows],
        whole.w2_blocks[:, :, first:last],
        whole.w2_scales[:, :, first:last],
        whole.w2_bias if rank == 0 else torch.zeros_like(whole.w2_bias),
        w2_offset=start - 32 * first,
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tp_ranks_whose_inputs_start_inside_a_group_sum_to_the_whole(backend: str) -> None:
    """Intermediate 96 over 2 ranks: rank 1's 48 inputs start 16 values into group 1."""
    whole = _experts(8, 96, torch.float32)
    x = _x(21, torch.float32)
    routing = _routing(21, 8, 2)
    parts = [_run(backend, x, _tp_slice(whole, r, 2), *routing) for r in range(2)]
    torch.testing.assert_close(
        parts[0] + parts[1], _run("torch", x, whole, *routing), rtol=1e-5, atol=1e-5
    )


def test_no_tokens_give_an_empty_output() -> None:
    experts = _experts(8, 64, torch.bfloat16)
    x = torch.zeros(0, HIDDEN, dtype=torch.bfloat16)
    routing = (torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    assert _run("triton", x, experts, *routing).shape == (0, HIDDEN)


def test_inconsistent_experts_are_refused_naming_the_tensor() -> None:
    experts = _experts(8, 64, torch.float32)
    x = _x(3, torch.float32)
    routing = _routing(3, 8, 2)
    short = Mxfp4Experts(**{**vars(experts), "w2_scales": experts.w2_scales[:, :, :1]})
    with pytest.raises(ValueError, match=r"w2: scales \[8, 64, 1\] must be blocks"):
        _run("triton", x, short, *routing)
    shifted = Mxfp4Experts(**{**vars(experts), "w2_offset": 8})
    with pytest.raises(ValueError, match=r"w2_blocks must be \[8, 64, 3, 16\] to hold inputs"):
        _run("torch", x, shifted, *routing)
    with pytest.raises(ValueError, match=r"w13_blocks must be \[experts, 2 \* intermediate, 1"):
        _run("torch", x[:, :32], experts, *routing)


# A wrapper whose launches are recorded, not run, feeds the next launch unwritten memory.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    ("dtype", "num_tokens", "rank"),
    [(torch.bfloat16, 1, 0), (torch.bfloat16, 3000, 1), (torch.float32, 200, 0)],
    ids=["decode-bf16", "prefill-bf16-offset-16", "fp32"],
)
def test_the_kernel_compiles_for_sm90_at_gpt_oss_shapes(
    monkeypatch: pytest.MonkeyPatch,
    aot_compiler: AotCompiler,
    dtype: torch.dtype,
    num_tokens: int,
    rank: int,
) -> None:
    """gpt-oss-120b's H 2880 at TP 4 (720 inputs per rank: rank 1's start 16 values into a
    group), 8 of its experts, top-4, compiled with the wrapper's own block sizes (the
    interpreter accepts code the real compiler rejects): no spills, tensor cores in bf16."""
    device = "cpu" if interpreter_enabled() else "cuda"
    num_experts, hidden, inter = 8, 2880, 720
    first = rank * inter // 32
    groups = -(-(rank + 1) * inter // 32) - first

    def zeros(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    experts = Mxfp4Experts(
        zeros(num_experts, 2 * inter, hidden // 32, 16),
        zeros(num_experts, 2 * inter, hidden // 32),
        zeros(num_experts, 2 * inter, dtype=dtype),
        zeros(num_experts, hidden, groups, 16),
        zeros(num_experts, hidden, groups),
        zeros(num_experts, hidden, dtype=dtype),
        w2_offset=rank * inter % 32,
    )
    x = zeros(num_tokens, hidden, dtype=dtype)
    routing = _routing(num_tokens, num_experts, 4)
    routing = tuple(t.to(device) for t in routing)
    launches = record_launches(
        monkeypatch, (triton_mxfp4_moe,), lambda: _run("triton", x, experts, *routing)
    )
    assert [launch.kernel for launch in launches] == ["_mxfp4_moe_gemm_kernel"] * 2
    for launch in launches:
        launch.args["DOT_UPCAST"] = False  # an interpreter-only upcast; never on a GPU
        answer = aot_compiler.compile(compile_job(launch, 90))
        assert "error" not in answer, answer.get("error")
        assert ".target sm_90" in answer["ptx"] and answer["cubin_size"] > 0
        assert answer["stack_bytes"] == 0, "the kernel spills registers"
        assert answer["shared"] <= 227 * 1024  # sm_90's most per block
        if dtype == torch.bfloat16:
            assert "mma" in answer["ptx"], "bf16 expert GEMMs should run on tensor cores"


@pytest.mark.gpu
def test_on_cuda_at_gpt_oss_shapes_the_kernel_is_within_bf16_of_float32() -> None:
    """gpt-oss-120b's hidden 2880 and TP 4 rank 1's 720 inputs (from value 16 of a group), 16
    experts, top-4, 64 tokens: the compiled kernel against the float32 torch path."""
    g = torch.Generator(device="cuda").manual_seed(0)
    num_experts, hidden, inter, num_tokens = 16, 2880, 720, 64
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, 2 * inter, device="cuda", generator=g) / inter**0.5
    w2_blocks, w2_scales = quantize_mxfp4(w2)
    experts = Mxfp4Experts(
        *quantize_mxfp4(w13),
        torch.randn(num_experts, 2 * inter, device="cuda", generator=g).bfloat16(),
        w2_blocks[:, :, 22:45].contiguous(),  # inputs [720, 1440) of 1440: groups 22 to 44
        w2_scales[:, :, 22:45].contiguous(),
        torch.randn(num_experts, hidden, device="cuda", generator=g).bfloat16(),
        w2_offset=16,
    )
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
    values, ids = torch.topk(logits, 4, dim=-1)
    routing = (values.softmax(dim=-1), ids)
    got = _run("auto", x, experts, *routing)
    as_fp32 = Mxfp4Experts(
        **{k: v.float() if k.endswith("bias") else v for k, v in vars(experts).items()}
    )
    exact = _run("torch", x.float(), as_fp32, *routing)
    atol = BF16_TOLERANCE * float(exact.abs().max())
    torch.testing.assert_close(got.float(), exact, rtol=0, atol=atol)
