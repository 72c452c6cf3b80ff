"""The packed oneDNN GEMM (``llm_kernels.cpu_gemm``) against ``F.linear`` on the unpacked weight,
and ``parallel.layers.pack_linear_weights`` on real parallel layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llm_kernels.cpu_gemm import pack_linear_weight, packed_gemm_available, packed_linear
from parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pack_linear_weights,
    parameter_bytes,
)

pytestmark = pytest.mark.skipif(
    not packed_gemm_available(torch.float32), reason="this torch has no oneDNN linear"
)

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, rows: int, bias: bool) -> None:
    if not packed_gemm_available(dtype):
        pytest.skip(f"no packed GEMM for {dtype} here")
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(200, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(200, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    packed = pack_linear_weight(weight)
    assert packed is not None
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, weight, b), atol=atol,
                               rtol=rtol)  # fmt: skip


def test_packed_linear_takes_batched_and_strided_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=g)
    packed = pack_linear_weight(weight)
    batched = torch.randn(3, 5, 32, generator=g)
    torch.testing.assert_close(packed_linear(batched, packed), F.linear(batched, weight))
    strided = torch.randn(32, 10, generator=g).t()  # [10, 32], not contiguous
    torch.testing.assert_close(packed_linear(strided, packed), F.linear(strided, weight))


def test_weights_the_packed_path_does_not_cover_are_not_packed() -> None:
    assert pack_linear_weight(torch.randn(8, 4, dtype=torch.float16)) is None
    assert pack_linear_weight(torch.randn(8)) is None
    assert pack_linear_weight(torch.randn(8, 4, device="meta")) is None


def _filled(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module


class _Model(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = _filled(VocabParallelEmbedding(50, 32), 1)
        self.qkv = _filled(QKVParallelLinear(32, 8, 4, 2, bias=True), 2)
        self.gate_up = _filled(MergedColumnParallelLinear(32, [48, 48]), 3)
        self.col = _filled(ColumnParallelLinear(32, 40), 4)
        self.row = _filled(RowParallelLinear(40, 32, bias=True), 5)
        self.head = _filled(ParallelLMHead(50, 32), 6)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> list[torch.Tensor]:
        x = self.embed(ids)
        return [self.qkv(x), self.gate_up(x), self.row(self.col(x)), self.head.compute_logits(x)]


@pytest.mark.parametrize("tied", [False, True])
def test_pack_linear_weights_keeps_outputs_and_releases_unshared_weights(tied: bool) -> None:
    model = _Model(tied)
    ids = torch.tensor([1, 7, 49, 3])
    shapes = {name: tuple(m.weight.shape) for name, m in model.named_children()}
    before = model(ids)
    nbytes = parameter_bytes(model)
    assert pack_linear_weights(model) == 5  # qkv, gate_up, col, row, head; never the embedding
    for got, want in zip(model(ids), before, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name in ("qkv", "gate_up", "col", "row"):
        module = getattr(model, name)
        assert module.weight.numel() == 0 and module.weight_shape == shapes[name]
    assert model.embed.packed_weight is None and model.embed.weight.shape == shapes["embed"]
    # A tied head keeps the embedding's weight (the embedding still reads it).
    assert (model.head.weight.numel() > 0) == tied
    assert pack_linear_weights(model) == 0  # packing twice is a no-op
    assert parameter_bytes(model) == nbytes  # counted as loaded, packed or not
