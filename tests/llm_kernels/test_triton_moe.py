"""Mixture-of-experts: the Triton fused-MoE kernels (through the interpreter without CUDA)
against the grouped torch path and a naive per-token loop, on uneven expert loads, experts with
no tokens, routers with tied logits, decode (T = 1), T not a multiple of BLOCK_M, E >= 8 and
top-k 2 and 4; the block alignment's invariants; expert parallelism through ``expert_map``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from llm_kernels import triton_moe, triton_ops
from llm_kernels.moe import fused_moe, moe_torch
from llm_kernels.triton_common import interpreter_enabled
from llm_kernels.triton_moe import fused_moe_triton, moe_align_block_size
from tests.llm_kernels.triton_aot import compile_job, record_launches

# fp32: ieee dots, only the summation order differs. fp16/bf16: GEMM-1 and SiLU outputs round
# to the input dtype in both paths, and the interpreter truncates float32 -> bf16 where torch
# rounds, so results differ by a few units in the last place (bf16: 1/128 relative).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
HIDDEN, INTERMEDIATE = 32, 64


@dataclass
class MoeCase:
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.w13, self.w2, self.topk_weights, self.topk_ids


def _route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax, top-k, renormalized over the k (Mixtral / Qwen3-MoE with norm_topk_prob)."""
    weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def _case(
    num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, logits: torch.Tensor
) -> MoeCase:
    g = torch.Generator().manual_seed(num_tokens * 100 + num_experts + top_k)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE**0.5
    weights, ids = _route(logits, top_k)
    return MoeCase(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)


def _random_logits(num_tokens: int, num_experts: int) -> torch.Tensor:
    return torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(7))


def _skewed_logits(num_tokens: int, num_experts: int) -> torch.Tensor:
    """Expert 0 takes every token, 1-3 share the rest, the last half of the experts none."""
    logits = _random_logits(num_tokens, num_experts)
    logits[:, num_experts // 2 :] = -1e4
    logits[:, 0] += 10.0
    return logits


def _tied_logits(num_tokens: int, num_experts: int) -> torch.Tensor:
    """Integer logits in {0, 1}: most tokens tie several experts at the top-k boundary, and
    every token's routing weights have equal entries."""
    return _random_logits(num_tokens, num_experts).gt(0).float()


def _per_token_loop(case: MoeCase) -> torch.Tensor:
    """The definition, in float64: one expert MLP per (token, k)."""
    out = torch.zeros(case.x.shape[0], HIDDEN, dtype=torch.float64)
    for t in range(case.x.shape[0]):
        for k in range(case.topk_ids.shape[1]):
            e = int(case.topk_ids[t, k])
            gate, up = (case.w13[e].double() @ case.x[t].double()).chunk(2)
            out[t] += case.topk_weights[t, k].double() * (case.w2[e].double() @ (F.silu(gate) * up))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


# (num_tokens, num_experts, top_k, logits, block_m): block_m None is the wrapper's choice.
ROUTINGS = [
    pytest.param(1, 8, 2, _random_logits, None, id="decode-T1-E8-k2"),
    pytest.param(1, 16, 4, _tied_logits, None, id="decode-T1-E16-k4-ties"),
    pytest.param(37, 8, 4, _skewed_logits, None, id="uneven-T37-E8-k4-4-empty-experts"),
    pytest.param(21, 8, 2, _tied_logits, None, id="ties-T21-E8-k2"),
    pytest.param(50, 8, 2, _random_logits, 32, id="T50-not-multiple-of-block-m-32"),
    pytest.param(19, 16, 4, _skewed_logits, 16, id="uneven-T19-E16-k4-8-empty-experts"),
]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "logits", "block_m"), ROUTINGS)
def test_torch_moe_equals_per_token_loop(num_tokens, num_experts, top_k, logits, block_m):
    case = _case(num_tokens, num_experts, top_k, torch.float32, logits(num_tokens, num_experts))
    _close(moe_torch(*case.args()), _per_token_loop(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "logits", "block_m"), ROUTINGS)
def test_triton_fused_moe_matches_torch_and_per_token_loop(
    dtype, num_tokens, num_experts, top_k, logits, block_m
):
    case = _case(num_tokens, num_experts, top_k, dtype, logits(num_tokens, num_experts))
    got = fused_moe_triton(*case.args(), block_m=block_m)
    _close(got, moe_torch(*case.args()), dtype)
    _close(got, _per_token_loop(case), dtype)


def test_skewed_routing_leaves_experts_without_tokens():
    """The uneven cases above do exercise empty experts and a crowded one."""
    _, ids = _route(_skewed_logits(37, 8), 4)
    loads = torch.bincount(ids.flatten(), minlength=8)
    assert loads[0] == 37 and loads[4:].sum() == 0 and loads[1:4].sum() == 37 * 3


def test_tied_logits_give_equal_routing_weights():
    weights, _ = _route(_tied_logits(21, 8), 2)
    assert (weights[:, 0] == weights[:, 1]).sum() >= 15


def test_a_token_may_pick_one_expert_twice():
    case = _case(5, 8, 2, torch.float32, _random_logits(5, 8))
    case.topk_ids[2] = 3
    want = _per_token_loop(case)
    _close(moe_torch(*case.args()), want, torch.float32)
    _close(fused_moe_triton(*case.args()), want, torch.float32)


@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_pads_each_expert_run_to_block_m(block_m):
    ids = torch.tensor([[5, 0], [5, 2], [0, 5], [7, 5], [5, 1]], dtype=torch.int32)
    align = moe_align_block_size(ids, num_experts=8, block_m=block_m)
    num_pairs, capacity = 10, align.sorted_pair_ids.shape[0]
    assert capacity % block_m == 0 and capacity >= num_pairs + 8 * (block_m - 1)
    # Experts 0, 1, 2, 5, 7 hold pairs (5 holds 5 < 16): one block each; 3, 4, 6 none.
    assert int(align.num_tokens_post_padded) == 5 * block_m
    used = align.block_expert_ids[:5].tolist()
    assert used == [0, 1, 2, 5, 7]
    assert (align.block_expert_ids[5:] == 8).all()
    flat = ids.flatten()
    for block, expert in enumerate(used):
        pairs = align.sorted_pair_ids[block * block_m : (block + 1) * block_m]
        real = pairs[pairs < num_pairs]
        assert (flat[real.long()] == expert).all()
        assert real.tolist() == sorted(real.tolist())  # stable: token order kept
        assert (pairs[len(real) :] == num_pairs).all()  # padding only after the real pairs
    assert sorted(align.sorted_pair_ids[align.sorted_pair_ids < num_pairs].tolist()) == list(
        range(num_pairs)
    )


def test_alignment_splits_a_run_longer_than_block_m_over_blocks():
    ids = torch.tensor([3] * 20 + [1] * 2)
    align = moe_align_block_size(ids, num_experts=4, block_m=16)
    assert int(align.num_tokens_post_padded) == 16 + 32
    assert align.block_expert_ids[:3].tolist() == [1, 3, 3]
    assert align.sorted_pair_ids[16:36].tolist() == list(range(20))


def test_alignment_leaves_out_pairs_on_other_ranks():
    ids = torch.tensor([-1, 0, -1, 1, 0])
    align = moe_align_block_size(ids, num_experts=2, block_m=16)
    assert int(align.num_tokens_post_padded) == 32
    assert align.sorted_pair_ids[:2].tolist() == [1, 4]
    assert align.sorted_pair_ids[16].item() == 3
    assert set(align.sorted_pair_ids.tolist()) == {1, 3, 4, 5}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_expert_parallel_halves_sum_to_the_whole(backend):
    """Two ranks with 8 experts each (expert_map) add up to one rank holding all 16."""
    case = _case(23, 16, 4, torch.float32, _random_logits(23, 16))
    whole = moe_torch(*case.args())
    parts = torch.zeros_like(whole)
    for rank in range(2):
        local = slice(8 * rank, 8 * rank + 8)
        expert_map = torch.full((16,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(8, dtype=torch.int32)
        parts += fused_moe(
            case.x,
            case.w13[local],
            case.w2[local],
            case.topk_weights,
            case.topk_ids,
            expert_map=expert_map,
            backend=backend,
        )
    _close(parts, whole, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tensor_parallel_intermediate_slices_sum_to_the_whole(backend):
    """Two ranks each holding half of every expert's intermediate dim add up to one rank."""
    case = _case(11, 8, 2, torch.float32, _random_logits(11, 8))
    whole = moe_torch(*case.args())
    gate, up = case.w13.chunk(2, dim=1)
    parts = torch.zeros_like(whole)
    for shard in (slice(0, INTERMEDIATE // 2), slice(INTERMEDIATE // 2, INTERMEDIATE)):
        w13 = torch.cat([gate[:, shard], up[:, shard]], dim=1)
        w2 = case.w2[:, :, shard]
        parts += fused_moe(case.x, w13, w2, case.topk_weights, case.topk_ids, backend=backend)
    _close(parts, whole, torch.float32)


def test_fused_moe_on_cpu_tensors_takes_the_torch_path(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton path ran for CPU tensors")

    monkeypatch.setattr(triton_moe, "fused_moe_triton", fail)
    case = _case(6, 8, 2, torch.bfloat16, _random_logits(6, 8))
    assert torch.equal(fused_moe(*case.args()), moe_torch(*case.args()))


def test_no_tokens_give_an_empty_output():
    case = _case(0, 8, 2, torch.float32, torch.zeros(0, 8))
    for backend in ("torch", "triton"):
        assert fused_moe(*case.args(), backend=backend).shape == (0, HIDDEN)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c, "w2", c.w2[:, :, :-1]), r"w2 must be \[8, 32, 64\]"),
        (lambda c: setattr(c, "w13", c.w13[:, :-1]), r"w13 must be \[experts, 2 \* inter"),
        (lambda c: setattr(c, "topk_ids", c.topk_ids.float()), "topk_ids must be an integer"),
        (lambda c: setattr(c, "topk_weights", c.topk_weights[:, :1]), "topk_weights must be"),
        (lambda c: setattr(c, "w2", c.w2.double()), "w2 must have x's dtype"),
        (lambda c: setattr(c, "topk_ids", c.topk_ids + 8), "topk_ids must be < the 8 experts"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change, message):
    case = _case(3, 8, 2, torch.float32, _random_logits(3, 8))
    change(case)
    with pytest.raises(ValueError, match=message):
        moe_torch(*case.args())


def test_unknown_backend_and_block_m_are_rejected():
    case = _case(3, 8, 2, torch.float32, _random_logits(3, 8))
    with pytest.raises(ValueError, match="backend must be one of"):
        fused_moe(*case.args(), backend="cuda")
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        fused_moe_triton(*case.args(), block_m=24)


def test_block_m_follows_mean_pairs_per_expert():
    assert triton_moe.moe_block_sizes(num_pairs=8, num_experts=128)[0] == 16
    assert triton_moe.moe_block_sizes(num_pairs=4096, num_experts=128)[0] == 32
    assert triton_moe.moe_block_sizes(num_pairs=65536, num_experts=64)[0] == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_gpu_fused_moe_matches_torch_at_qwen3_moe_sizes(num_tokens):
    """Qwen3-30B-A3B's expert shapes (128 experts, top-8, H 2048, I 768), compiled kernel."""
    g = torch.Generator(device="cuda").manual_seed(0)
    num_experts, hidden, inter = 128, 2048, 768
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).bfloat16()
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=g) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
    weights, ids = _route(logits, 8)
    args = (x, w13.bfloat16(), w2.bfloat16(), weights, ids)
    got = fused_moe(*args)
    torch.testing.assert_close(got.float(), moe_torch(*args).float(), atol=3e-2, rtol=3e-2)


# A wrapper whose launches are recorded, not run, feeds the next launch unwritten memory.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    ("dtype", "num_tokens"),
    [(torch.bfloat16, 1), (torch.bfloat16, 3000), (torch.float32, 200)],
    ids=["decode-bf16-block-m-16", "prefill-bf16-block-m-64", "fp32-block-m-32"],
)
def test_fused_moe_kernels_compile_for_sm90(monkeypatch, aot_compiler, dtype, num_tokens):
    """Mixtral-like expert shapes (E 8, top-2, H 1024, I 896: a K tail in GEMM 2), compiled
    ahead of time with the wrapper's own block sizes, as tests/llm_kernels/test_triton_compile.py
    does for the other kernels (the interpreter accepts code the real compiler rejects)."""
    device = "cpu" if interpreter_enabled() else "cuda"
    num_experts, hidden, inter = 8, 1024, 896
    x = torch.zeros(num_tokens, hidden, dtype=dtype, device=device)
    w13 = torch.zeros(num_experts, 2 * inter, hidden, dtype=dtype, device=device)
    w2 = torch.zeros(num_experts, hidden, inter, dtype=dtype, device=device)
    logits = torch.randn(num_tokens, num_experts, device=device)
    args = (x, w13, w2, *_route(logits, 2))
    launches = record_launches(
        monkeypatch, (triton_moe, triton_ops), lambda: fused_moe(*args, backend="triton")
    )
    assert [launch.kernel for launch in launches] == [
        "_moe_gemm_kernel",
        "_act_and_mul_kernel",
        "_moe_gemm_kernel",
    ]
    for launch in launches:
        if "DOT_UPCAST" in launch.args:  # an interpreter-only upcast; a GPU launch never has it
            launch.args["DOT_UPCAST"] = False
        answer = aot_compiler.compile(compile_job(launch, 90))
        assert "error" not in answer, answer.get("error")
        assert ".target sm_90" in answer["ptx"] and answer["cubin_size"] > 0
        assert answer["stack_bytes"] == 0, f"{launch.kernel} spills registers"
        if launch.kernel == "_moe_gemm_kernel" and dtype == torch.bfloat16:
            assert "mma" in answer["ptx"], "bf16 expert GEMMs should run on tensor cores"
