"""``ParallelExperts.pack_weights``: the experts packed into oneDNN's layout on CPU give what
the plain stacked weights give (bfloat16 exactly, float32 to rounding), with and without the
projection biases and under expert parallelism, and count at their plain size."""

from __future__ import annotations

import pytest
import torch

from llm_kernels.cpu_gemm import packed_gemm_available
from llm_kernels.ops import silu_and_mul
from parallel.layers import parameter_bytes
from parallel.moe import ParallelExperts, pack_expert_weights
from parallel.state import GroupCoordinator

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 8, 64, 48, 3


def _experts(dtype: torch.dtype, *, biased: bool, expert_parallel: bool) -> ParallelExperts:
    tp = GroupCoordinator(rank=1, size=2, ranks=(0, 1)) if expert_parallel else None
    kwargs = {"tp": tp, "expert_parallel": True} if tp is not None else {}
    experts = ParallelExperts(NUM_EXPERTS, HIDDEN, INTER, silu_and_mul, **kwargs)
    g = torch.Generator().manual_seed(0)
    for param in (experts.gate_up_proj, experts.down_proj):
        param.data = (torch.randn(param.shape, generator=g) * 0.1).to(dtype)
    if biased:
        local = experts.num_local_experts
        experts.gate_up_proj_bias = torch.nn.Parameter(
            torch.randn(local, 2 * INTER, generator=g).to(dtype), requires_grad=False
        )
        experts.down_proj_bias = torch.nn.Parameter(
            torch.randn(local, HIDDEN, generator=g).to(dtype), requires_grad=False
        )
    return experts


def _routing(num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return x, ids, weights.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_packed_experts_equal_the_plain_ones(
    dtype: torch.dtype, biased: bool, expert_parallel: bool
) -> None:
    if not packed_gemm_available(dtype):
        pytest.skip(f"no packed oneDNN GEMM for {dtype} in this torch")
    experts = _experts(dtype, biased=biased, expert_parallel=expert_parallel)
    for num_tokens in (1, 5, 40):
        x, ids, weights = _routing(num_tokens, dtype)
        plain = experts(x, ids, weights)
        if num_tokens == 1:
            assert pack_expert_weights(experts) == 1
        packed = experts(x, ids, weights)
        if dtype == torch.bfloat16:
            assert torch.equal(packed, plain)
        else:
            torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
        if expert_parallel:  # rank 1 of 2 owns experts 4..7: a token routed elsewhere is 0
            elsewhere = (ids < NUM_EXPERTS // 2).all(dim=-1)
            assert not packed[elsewhere].any()


def test_packing_releases_the_plain_weights_and_keeps_their_bytes() -> None:
    if not packed_gemm_available(torch.float32):
        pytest.skip("no packed oneDNN GEMM in this torch")
    experts = _experts(torch.float32, biased=True, expert_parallel=False)
    before = parameter_bytes(experts)
    assert experts.pack_weights()
    assert experts.gate_up_proj.is_meta and experts.down_proj.is_meta
    assert experts.gate_up_proj.shape == (NUM_EXPERTS, 2 * INTER, HIDDEN)
    assert parameter_bytes(experts) == before
    assert not experts.pack_weights()  # packing twice is a no-op
