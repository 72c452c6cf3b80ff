"""An MXFP4 checkpoint's experts (gpt-oss) turned into what the model holds, as the loader
streams the tensors.

Each stacked expert projection ``X`` (``mlp.experts.gate_up_proj`` / ``down_proj``) is stored
as two tensors, in either order and possibly in different shard files::

    X_blocks  [E, out, in / 32, 16] uint8      (llm_kernels.mxfp4: E2M1 codes, two per byte)
    X_scales  [E, out, in / 32]     uint8      (E8M0 exponents, one per 32 values)

where HF's in-memory ``X`` is ``[E, in, out]`` (gate_up_proj ``[E, H, 2I]`` with gate and up
columns interleaved, down_proj ``[E, I, H]``). The first of the pair to arrive is read and
waits for the other; then either

- the model keeps MXFP4 (its experts have ``X_blocks`` / ``X_scales`` parameters:
  ``keeps_mxfp4_experts``, the Triton kernels): both go on under their own names, and the
  experts' loaders cut their rank's rows; or
- one tensor ``X`` goes on, a :class:`DequantizedExperts` that reads as HF's dense ``X`` in
  the model's dtype: the experts' loader indexes it for its rank's experts and columns, and
  only that part is dequantized, bit for bit as transformers does it.

The pairs' names, dtypes and shapes are checked from the safetensors headers before the model
is built (``mxfp4_weights``), and again on the tensors as they pair up.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine import hf_config
from engine.errors import ConfigError
from llm_kernels.mxfp4 import BYTES_PER_GROUP, VALUES_PER_SCALE, dequantize_mxfp4

_PAIR = re.compile(
    r"^(?P<weight>.+\.mlp\.experts\.(gate_up_proj|down_proj))_(?P<part>blocks|scales)$"
)
_ANY_PART = re.compile(r"^(?P<weight>.+)_(?P<part>blocks|scales)$")


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)


def _dtype_code(t: Any) -> str:
    if hasattr(t, "get_dtype"):
        return str(t.get_dtype())
    return "U8" if t.dtype == torch.uint8 else str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class _ExpertShapes:
    """The stacked expert projections' sizes a model's config gives."""

    num_experts: int
    hidden: int
    intermediate: int

    @classmethod
    def of(cls, hf: Mapping[str, Any]) -> _ExpertShapes:
        conf = dict(hf)
        return cls(
            hf_config.num_experts(conf),
            int(hf["hidden_size"]),
            hf_config.moe_intermediate_size(conf),
        )

    def check_pair(
        self,
        weight: str,
        blocks_dtype: str,
        blocks_shape: tuple[int, ...],
        scales_dtype: str,
        scales_shape: tuple[int, ...],
    ) -> None:
        """Both uint8; blocks ``[E, out, in / 32, 16]`` for this model's E, out and in, scales
        the blocks' shape without its last dim; ValueError naming the tensor otherwise."""
        for part, dtype in (("blocks", blocks_dtype), ("scales", scales_dtype)):
            if dtype != "U8":
                raise ValueError(f"{weight}_{part}: MXFP4 {part} must be U8 (uint8), got {dtype}")
        gate_up = weight.endswith("gate_up_proj")
        out, in_ = (
            (2 * self.intermediate, self.hidden) if gate_up else (self.hidden, self.intermediate)
        )
        in_name = "hidden_size" if gate_up else "the experts' intermediate size"
        if in_ % VALUES_PER_SCALE:
            raise ConfigError(
                f"{weight}: {in_name} {in_} is not a multiple of {VALUES_PER_SCALE} (MXFP4 groups)"
            )
        expected = (self.num_experts, out, in_ // VALUES_PER_SCALE, BYTES_PER_GROUP)
        if tuple(blocks_shape) != expected:
            raise ValueError(
                f"{weight}_blocks: shape {list(blocks_shape)} != expected {list(expected)} "
                f"([experts, out, in / {VALUES_PER_SCALE}, {BYTES_PER_GROUP}] for {in_} inputs, "
                f"{in_name})"
            )
        if tuple(scales_shape) != tuple(blocks_shape[:-1]):
            raise ValueError(
                f"{weight}_scales: shape {list(scales_shape)} does not match "
                f"{weight}_blocks {list(blocks_shape)} (expected {list(blocks_shape[:-1])})"
            )


def _weight_of(name: str) -> str:
    """``X`` of ``X_blocks`` / ``X_scales``; ValueError unless X is a stacked expert projection."""
    match = _PAIR.match(name)
    if match is None:
        raise ValueError(
            f"checkpoint tensor {name!r}: MXFP4 is read only for stacked expert "
            "projections (mlp.experts.gate_up_proj / down_proj _blocks and _scales)"
        )
    return match["weight"]


def mxfp4_weights(
    hf: Mapping[str, Any], headers: Mapping[str, tuple[str, tuple[int, ...]]]
) -> frozenset[str]:
    """The expert projections ``X`` an MXFP4 checkpoint stores as ``X_blocks`` / ``X_scales``,
    from every tensor's (safetensors dtype code, shape) in the files' headers: each pair
    complete, a stacked expert projection, its dtypes and shapes this model's. Raises naming
    the tensor before anything is built or read."""
    shapes = _ExpertShapes.of(hf)
    weights = set()
    for name in sorted(headers):
        match = _ANY_PART.match(name)
        if match is None:
            continue
        weight = _weight_of(name)
        partner = f"{weight}_{'scales' if match['part'] == 'blocks' else 'blocks'}"
        if partner not in headers:
            raise ValueError(f"checkpoint: {name!r} has no {partner!r} (MXFP4 pairs them)")
        weights.add(weight)
    for weight in sorted(weights):
        shapes.check_pair(weight, *headers[f"{weight}_blocks"], *headers[f"{weight}_scales"])
    return frozenset(weights)


class Mxfp4Checkpoint:
    """Pairs each expert projection's ``_blocks`` with its ``_scales`` in the tensor stream.

    ``kept``: the model keeps MXFP4 (its experts have ``X_blocks`` parameters); ``dtype``: the
    model's, which a dequantized ``X`` takes."""

    def __init__(self, hf: Mapping[str, Any], kept: bool, dtype: torch.dtype) -> None:
        self.shapes = _ExpertShapes.of(hf)
        self.kept = kept
        self.dtype = dtype

    def weight_name(self, name: str) -> str:
        """The parameter a checkpoint tensor's bytes load into (``X_blocks`` -> ``X`` where it
        is dequantized), for counting what each rank reads."""
        match = _PAIR.match(name)
        if match is None or self.kept:
            return name
        return match["weight"]

    def transform(self, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``weights`` with each pair checked and, unless kept, replaced by its ``X``."""
        pending: dict[str, dict[str, Any]] = {}
        for name, tensor in weights:
            match = _ANY_PART.match(name)
            if match is None:
                yield name, tensor
                continue
            weight = _weight_of(name)
            parts = pending.setdefault(weight, {})
            parts[match["part"]] = tensor
            if len(parts) == 1:
                # Read now: a lazy slice dies with its shard file, the partner may be in the next.
                parts[match["part"]] = tensor[:] if not isinstance(tensor, Tensor) else tensor
                continue
            del pending[weight]
            blocks, scales = parts["blocks"], parts["scales"]
            self.shapes.check_pair(
                weight, _dtype_code(blocks), _shape(blocks), _dtype_code(scales), _shape(scales)
            )
            if self.kept:
                yield f"{weight}_blocks", blocks
                yield f"{weight}_scales", scales
            else:
                yield weight, DequantizedExperts(blocks, scales, self.dtype)
        if pending:
            weight, parts = next(iter(pending.items()))
            (part,) = parts
            missing = "scales" if part == "blocks" else "blocks"
            raise ValueError(f"checkpoint: {weight}_{part} has no {weight}_{missing}")

    def attach_activation_quant(self, model: Any, target_of: Any) -> int:
        """Nothing to attach: MXFP4 quantizes no activations."""
        return 0


class DequantizedExperts:
    """A stacked MXFP4 expert weight read as HF's dense ``[E, in, out]`` tensor in ``dtype``.

    Indexing with up to three unit-step slices (experts, in, out) dequantizes only what they
    select: the experts' rows of ``blocks`` / ``scales``, the output rows, and the 32-value
    groups that cover the input range; the result is a ``[e, in, out]`` tensor."""

    def __init__(self, blocks: Any, scales: Any, dtype: torch.dtype) -> None:
        self.blocks = blocks  # [E, out, G, 16], a tensor or a lazy safetensors slice
        self.scales = scales  # [E, out, G]
        self.dtype = dtype
        num_experts, out, groups, _ = _shape(blocks)
        self.shape = torch.Size((num_experts, groups * VALUES_PER_SCALE, out))

    def __getitem__(self, index: Any) -> Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3 or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            raise TypeError(f"DequantizedExperts: index with up to 3 unit-step slices, got {index}")
        experts, in_, out = (*index, slice(None), slice(None))[:3]
        start, stop, _ = in_.indices(self.shape[1])
        stop = max(stop, start)
        first = start // VALUES_PER_SCALE
        end = -(-stop // VALUES_PER_SCALE)
        blocks = self.blocks[experts, out, first:end]
        scales = self.scales[experts, out, first:end]
        dense = dequantize_mxfp4(blocks, scales, self.dtype)  # [e, out, covered in]
        offset = first * VALUES_PER_SCALE
        return dense[..., start - offset : stop - offset].transpose(1, 2)

    def __repr__(self) -> str:
        return f"DequantizedExperts(shape={list(self.shape)}, dtype={self.dtype})"
