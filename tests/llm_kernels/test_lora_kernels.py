"""Multi-LoRA deltas: the grouped torch path against a per-token loop, and the Triton kernels
(through the interpreter without CUDA) against the torch path, on batches mixing slots, tokens
without an adapter (slot -1) and ranks zero-padded to the slot width."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_kernels import lora, triton_lora
from llm_kernels.lora import LoRAMapping

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-2}


def _weights(
    num_slots: int, max_rank: int, ranks: list[int], in_f: int, out_f: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked A [slots, R, in] and B [slots, out, R]: slot s holds a rank ranks[s] adapter,
    zero beyond its rank, as the engine pads them."""
    g = torch.Generator().manual_seed(1)
    a = torch.zeros(num_slots, max_rank, in_f)
    b = torch.zeros(num_slots, out_f, max_rank)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_f, generator=g) / in_f**0.5
        b[s, :, :r] = torch.randn(out_f, r, generator=g)
    return a.to(dtype), b.to(dtype)


def _per_token(x, a, b, slots) -> torch.Tensor:
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            delta[t] = b[s].double() @ (a[s].double() @ x[t].double())
    return delta


def _case(num_tokens: int, dtype: torch.dtype, seed: int):
    rng = np.random.default_rng(seed)
    slots = rng.integers(-1, 3, size=num_tokens).astype(np.int32)
    a, b = _weights(3, 16, [16, 8, 4], in_f=96, out_f=80, dtype=dtype)
    x = torch.randn(num_tokens, 96, generator=torch.Generator().manual_seed(seed)).to(dtype)
    y = torch.randn(num_tokens, 80, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return x, y, a, b, slots


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_torch_grouped_delta_equals_per_token_loop(num_tokens):
    x, y, a, b, slots = _case(num_tokens, torch.float32, seed=num_tokens)
    want = y.double() + _per_token(x, a, b, torch.from_numpy(slots))
    got = y.clone()
    lora.add_lora(got, x, a, b, LoRAMapping.build(slots, x.device))
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_tokens_without_adapter_are_untouched():
    x, y, a, b, _ = _case(5, torch.float32, seed=0)
    slots = np.array([-1, 0, -1, 2, -1], dtype=np.int32)
    for impl in (lora, triton_lora):
        got = y.clone()
        impl.add_lora(got, x, a, b, LoRAMapping.build(slots, x.device))
        assert torch.equal(got[slots < 0], y[slots < 0])
        assert not torch.equal(got[slots >= 0], y[slots >= 0])


def test_one_slot_for_every_token_needs_no_gather():
    x, y, a, b, _ = _case(6, torch.float32, seed=3)
    mapping = LoRAMapping.build(np.full(6, 1, dtype=np.int32), x.device)
    assert mapping.groups == [(1, None)]
    got = y.clone()
    lora.add_lora(got, x, a, b, mapping)
    torch.testing.assert_close(got, y + (x @ a[1].T) @ b[1].T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
def test_triton_add_lora_matches_torch(dtype, num_tokens):
    x, y, a, b, slots = _case(num_tokens, dtype, seed=10 + num_tokens)
    mapping = LoRAMapping.build(slots, x.device)
    want, got = y.clone(), y.clone()
    lora.add_lora(want, x, a, b, mapping)
    triton_lora.add_lora(got, x, a, b, mapping)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_triton_shrink_then_expand_match_torch_with_non_power_of_two_rank():
    # R = 24 (3 slices x rank 8, as a fused qkv adapter is stacked) and strided rows of x.
    a, b = _weights(2, 24, [24, 5], in_f=70, out_f=130, dtype=torch.float32)
    wide = torch.randn(11, 100)
    x = wide[:, 10:80]
    slots = np.array([1, 0, -1, 0, 1, 1, -1, -1, 0, 1, 0], dtype=np.int32)
    mapping = LoRAMapping.build(slots, x.device)
    v = triton_lora.lora_shrink(x, a, mapping)
    torch.testing.assert_close(v, lora.lora_shrink(x, a, mapping), atol=1e-4, rtol=1e-4)
    y = torch.randn(11, 130)
    want, got = y.clone(), y.clone()
    lora.lora_expand(want, v, b, mapping)
    triton_lora.lora_expand(got, v, b, mapping)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_triton_rejects_a_slot_count_that_does_not_match_the_tokens():
    x, y, a, b, _ = _case(4, torch.float32, seed=0)
    mapping = LoRAMapping.build(np.zeros(3, dtype=np.int32), x.device)
    with pytest.raises(ValueError, match="token_slots has 3 entries for 4 tokens"):
        triton_lora.add_lora(y, x, a, b, mapping)
