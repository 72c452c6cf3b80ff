"""Quantized weights kept quantized in the layers (CUDA; on CPU only when asked for with
``LLM_CLUSTER_CPU_KEEP_QUANTIZED=1``), multiplied by ``llm_kernels.quant_gemm``.

The loader hands each layer's ``weight_loader`` a ``QuantizedWeight`` instead of a dense
tensor: it has the full weight's ``shape`` and slices like one (``w[rows]``, ``w[:, cols]``),
taking its scales, zero points and packed int4 words along, so the layers' column / row /
fused-part sharding stays the one code path. A slice that would cut a scale block, a
quantization group or an int32 of eight int4 values raises, naming the group. The layer's
dense ``weight`` stays a meta tensor of the shard's shape; ``store_into`` writes the slice
into the layer's ``QuantizedLinearMethod``, which its forward calls.

Forms: FP8 e4m3 ``[N, K]`` with a float32 scale per output row (a per-tensor scale, one per
fused part, expanded to its rows) or a block grid; int4 in compressed-tensors' pack layout
(``formats``) with scales and unpacked zero points per group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from engine.quantization.config import QuantScheme
from engine.quantization.formats import (
    pack_nibbles,
    quantize_fp8_per_tensor,
    unpack_ct_zero_points,
)
from llm_kernels import quant_gemm


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear weight in its quantized form, whole or sliced (``rows``/``cols``: where the
    slice starts in the full weight, for the alignment errors)."""

    scheme: QuantScheme
    data: torch.Tensor  # fp8 [N, K] or int32 [N, K // 8]
    scale: torch.Tensor  # fp8: [] / [N] / block grid; int4: [N, G]
    zero_point: torch.Tensor | None  # int4 asymmetric: int8 [N, G]
    input_scale: torch.Tensor | None  # static FP8 activations
    in_features: int
    device: torch.device  # where the layer keeps it

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.in_features)

    @property
    def _block(self) -> tuple[int, int] | None:
        return self.scheme.block if self.scheme.kind == "fp8" else None

    def __getitem__(self, index: Any) -> QuantizedWeight:
        if isinstance(index, slice):
            return self._rows(index.start or 0, index.stop)
        cols = index[1]
        return self._cols(cols.start or 0, cols.stop)

    def _rows(self, start: int, stop: int) -> QuantizedWeight:
        stop = min(stop, self.shape[0])
        scale, zp = self.scale, self.zero_point
        block = self._block
        if block is not None:
            bn = block[0]
            _aligned(start, stop, bn, self.shape[0], f"an FP8 block of {bn} output rows")
            scale = scale[start // bn : -(-stop // bn)]
        elif scale.dim() > 0 and scale.numel() > 1:
            scale = scale[start:stop]
        if zp is not None:
            zp = zp[start:stop]
        return replace(self, data=self.data[start:stop], scale=scale, zero_point=zp)

    def _cols(self, start: int, stop: int) -> QuantizedWeight:
        stop = min(stop, self.in_features)
        k = self.in_features
        if self.scheme.kind == "fp8":
            block = self._block
            scale = self.scale
            if block is not None:
                bk = block[1]
                _aligned(start, stop, bk, k, f"an FP8 block of {bk} input columns")
                scale = scale[:, start // bk : -(-stop // bk)]
            return replace(
                self, data=self.data[:, start:stop], scale=scale, in_features=stop - start
            )
        _aligned(start, stop, 8, k, "an int32 of eight int4 values")
        scale, zp = self.scale, self.zero_point
        group = self.scheme.group_size
        if group is not None:  # per-channel scales belong to rows: nothing to cut
            _aligned(start, stop, group, k, f"a quantization group of {group} input columns")
            g0, g1 = start // group, -(-stop // group)
            scale = scale[:, g0:g1]
            zp = None if zp is None else zp[:, g0:g1]
        return replace(
            self,
            data=self.data[:, start // 8 : -(-stop // 8)],
            scale=scale,
            zero_point=zp,
            in_features=stop - start,
        )

    def store_into(self, layer: nn.Module, row_offset: int) -> None:
        """Write this slice into ``layer``'s quantized weight at ``row_offset`` (creating it on
        the first part), for the layer's forward."""
        method = layer.quant_method
        if method is None:
            rows = layer.weight.shape[0]
            method = QuantizedLinearMethod(self.scheme, rows, self.in_features, self)
            layer.quant_method = method
        method.write(self, row_offset)


def _aligned(start: int, stop: int, unit: int, size: int, what: str) -> None:
    if start % unit or (stop % unit and stop != size):
        raise ValueError(
            f"tensor parallelism would cut {what} (this rank's share is columns/rows "
            f"[{start}, {stop}) of {size}); choose a tensor_parallel_size that keeps each whole"
        )


class QuantizedLinearMethod:
    """A layer's quantized weight shard and its GEMM (``llm_kernels.quant_gemm``)."""

    def __init__(self, scheme: QuantScheme, rows: int, k: int, like: QuantizedWeight) -> None:
        self.scheme = scheme
        device = like.device
        self.data = torch.empty((rows, like.data.shape[1]), dtype=like.data.dtype, device=device)
        if scheme.kind == "fp8" and scheme.block is not None:
            bn, bk = scheme.block
            self.scale = torch.empty((-(-rows // bn), -(-k // bk)), device=device)
        elif scheme.kind == "fp8":
            self.scale = torch.empty(rows, dtype=torch.float32, device=device)
        else:
            self.scale = torch.empty(
                (rows, like.scale.shape[1]), dtype=like.scale.dtype, device=device
            )
        self.zero_point = (
            None
            if like.zero_point is None
            else torch.empty((rows, like.scale.shape[1]), dtype=torch.int8, device=device)
        )
        # Static input scales: (first row, end row, scale) per fused part, in row order.
        self.segments: list[tuple[int, int, torch.Tensor]] = []

    def write(self, w: QuantizedWeight, offset: int) -> None:
        n = w.data.shape[0]
        self.data[offset : offset + n].copy_(w.data)
        if self.scheme.kind == "fp8" and self.scheme.block is not None:
            bn = self.scheme.block[0]
            if offset % bn:
                raise ValueError(f"a fused part starts inside an FP8 block of {bn} rows")
            self.scale[offset // bn : offset // bn + w.scale.shape[0]].copy_(w.scale)
        elif self.scheme.kind == "fp8":
            # A per-tensor scale (one per checkpoint tensor) becomes its rows' scale.
            self.scale[offset : offset + n].copy_(w.scale.to(torch.float32).reshape(-1).expand(n))
        else:
            self.scale[offset : offset + n].copy_(w.scale)
            if self.zero_point is not None:
                self.zero_point[offset : offset + n].copy_(w.zero_point)
        if w.input_scale is not None:
            self.segments.append((offset, offset + n, w.input_scale.to(self.data.device)))
            self.segments.sort(key=lambda seg: seg[0])

    def nbytes(self) -> int:
        tensors = [self.data, self.scale, self.zero_point]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.scheme.kind == "int4":
            group = self.scheme.group_size or x.shape[-1]
            return quant_gemm.w4a16_linear(
                x, self.data, self.scale, self.zero_point, group, bias
            ).to(x.dtype)
        block = self.scheme.block
        if not self.segments:
            return quant_gemm.fp8_linear(x, self.data, self.scale, block, None, bias, x.dtype)
        outs = []
        for start, end, input_scale in self.segments:
            scale = self.scale[start:end]
            part_bias = None if bias is None else bias[start:end]
            outs.append(
                quant_gemm.fp8_linear(
                    x, self.data[start:end], scale, None, input_scale, part_bias, x.dtype
                )
            )
        return torch.cat(outs, dim=-1)


def kept_problem(scheme: QuantScheme) -> str | None:
    """Why ``scheme`` cannot be served by ``llm_kernels.quant_gemm`` as the checkpoint means it
    (None: it can). The FP8 GEMM always quantizes activations: per token and ``bk`` group
    with block weights, per token (or the static scale) otherwise."""
    if scheme.kind != "fp8" or scheme.source == "online-fp8":
        return None  # int4 is weight-only; online FP8 is W8A8 on the GPU by definition
    acts = scheme.activations
    if acts is None:
        return "FP8 weights without activation quantization (W8A16)"
    if scheme.block is not None:
        if not acts.dynamic or acts.group_size != scheme.block[1]:
            return (
                f"block weights {list(scheme.block)} need dynamic activations per group of "
                f"{scheme.block[1]}"
            )
    elif acts.dynamic and acts.group_size is not None:
        return "per-group activations with non-block weights"
    return None


def quantized_form(
    scheme: QuantScheme,
    parts: dict[str, torch.Tensor],
    device: torch.device,
    int4_of_gptq_awq: Any,
) -> QuantizedWeight:
    """One module's checkpoint tensors as the ``QuantizedWeight`` the layer keeps."""
    input_scale = parts.get("input_scale")
    if scheme.source == "online-fp8":
        q, scale = quantize_fp8_per_tensor(parts["weight"])
        return QuantizedWeight(scheme, q, scale, None, None, q.shape[1], device)
    if scheme.kind == "fp8":
        scale_name = "weight_scale_inv" if scheme.source == "fp8-block" else "weight_scale"
        weight, scale = parts["weight"], parts[scale_name].to(torch.float32)
        if scheme.strategy == "channel":
            scale = scale.reshape(-1)
        return QuantizedWeight(scheme, weight, scale, None, input_scale, weight.shape[1], device)
    if scheme.source == "ct-pack-quantized":
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        zp = parts.get("weight_zero_point")
        zp = None if zp is None else unpack_ct_zero_points(zp, n).contiguous()
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        return QuantizedWeight(scheme, packed, scale, zp, None, k, device)
    if scheme.source in ("gptq", "awq"):
        q, zp, scale = int4_of_gptq_awq(scheme, parts)
    else:  # naive-quantized int4: int8 values
        q, zp, scale = parts["weight"], parts.get("weight_zero_point"), parts["weight_scale"]
    packed = pack_nibbles(q.to(torch.int32) + 8)
    zp = None if zp is None else zp.to(torch.int8).contiguous()
    return QuantizedWeight(scheme, packed, scale.contiguous(), zp, None, q.shape[1], device)
