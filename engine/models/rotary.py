"""Rotary position embedding for every rope type of transformers 5's decoder LMs (default,
linear, dynamic, llama3, yarn, longrope), and ``RopeCache``: one cos/sin table per distinct
rope, shared by every layer that uses it (one pair per layer cost Llama-3.1-70B gigabytes per
GPU: BENCHMARKS.md, "Rotary tables").

Tables. ``cos``/``sin`` are float32 ``[max_position, rotary_dim]``, both halves repeated
(neox / HF ``rotate_half`` layout), the contract of ``ops.rotary_embedding``. With partial
rotary (``partial_rotary_factor`` < 1, Phi-4-mini) only the first ``rotary_dim =
int(head_dim * partial_rotary_factor)`` dimensions of each head rotate and the rest pass
through, as in HF. ``rope_cos_sin`` builds them exactly as HF rounds; the position-dependent
types (``dynamic``, ``longrope``) give every position one fixed rotation, so a position's K
never depends on the batch it was computed in (``_inv_freq_per_position``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from engine.rope_config import ROPE_TYPES, freeze_rope_params
from llm_kernels.backend import KernelOps, get_kernel_ops

__all__ = ["RopeCache", "RotaryEmbedding", "rope_cos_sin", "rotary_dim"]


def rotary_dim(head_dim: int, params: Mapping[str, Any]) -> int:
    """How many leading dimensions of each head rotate (HF: ``int(head_dim * factor)``);
    raises ValueError for an unsupported rope type or an odd rotary dim."""
    rope_type = params.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type: {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if dim < 2 or dim % 2 or dim > head_dim:
        raise ValueError(
            f"partial_rotary_factor: {params.get('partial_rotary_factor')!r} gives rotary dim "
            f"{dim} of head_dim {head_dim}; it must be even and in [2, head_dim]"
        )
    return dim


def rope_cos_sin(
    head_dim: int, max_position: int, params: Mapping[str, Any]
) -> tuple[Tensor, Tensor]:
    """float32 cos and sin ``[max_position, rotary_dim]`` on the CPU for the normalized
    ``params`` of ``engine.rope_config.rope_parameters``.

    Exactness against HF. The inverse frequencies are computed with transformers' float32
    arithmetic, and each angle is ``float32(position) * inv_freq`` rounded to float32 as HF
    rounds it (at position 100k that rounding alone moves the angle by up to 4e-3 rad, so a
    more exact angle would differ from what the checkpoint was run with). Only cos/sin of that
    angle are evaluated in float64, scaled by the attention factor and rounded once. The
    dynamic NTK base is raised to its power in float64: HF computes it on a 0-dim tensor,
    through libm's scalar powf, which float64-then-round reproduces and a vectorized float32
    pow over all positions does not.
    """
    if max_position < 1:
        raise ValueError(f"max_position: must be >= 1, got {max_position}")
    dim = rotary_dim(head_dim, params)
    positions = torch.arange(max_position, dtype=torch.int64, device="cpu")
    inv_freq = _inv_freq_per_position(dim, positions, params)
    # One float32 rounding of the angle, exactly HF's; cos/sin of it evaluated in float64.
    angles = positions.to(torch.float32)[:, None] * inv_freq
    scale = float(params.get("attention_factor", 1.0))
    angles64 = angles.to(torch.float64)
    cos = (angles64.cos() * scale).to(torch.float32)
    sin = (angles64.sin() * scale).to(torch.float32)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _exponents(dim: int) -> Tensor:
    """2i / dim for the dim / 2 frequency pairs, float32 as in HF."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim


def _plain_inv_freq(dim: int, base: float | Tensor) -> Tensor:
    return 1.0 / (base ** _exponents(dim))


def _inv_freq_per_position(dim: int, positions: Tensor, params: Mapping[str, Any]) -> Tensor:
    """``[dim / 2]`` inverse frequencies, or ``[P, dim / 2]`` for the types whose frequencies
    depend on the position.

    HF recomputes the ``dynamic`` and ``longrope`` frequencies from the length of the sequence
    in the forward call (``dynamic_rope_update``). Here every position has one fixed rotation:
    the one HF gives it when it decodes that position token by token, i.e. with
    ``seq_len = p + 1``::

        dynamic:   NTK base for seq_len = max(p + 1, original length); positions below the
                   original length keep the plain base
        longrope:  short_factor for p < original_max_position_embeddings, long_factor beyond

    So a position's K never depends on the batch it was computed in, and chunked prefill,
    prefix caching and recompute after preemption stay exact. This equals HF's ``generate()``
    whenever the prompt fits in the original context (every later position is decoded one at a
    time). A prompt longer than that is where we differ, on purpose: HF's one-shot prefill
    rotates all of its positions, those inside the original context included, with the
    frequencies of the full prompt length (dynamic: one NTK base for all; longrope: long
    factors for all).
    """
    rope_type, theta = params["rope_type"], float(params["rope_theta"])
    if rope_type == "default":
        return _plain_inv_freq(dim, theta)
    if rope_type == "linear":
        # Scaling positions by 1 / factor is scaling the frequencies by it.
        return _plain_inv_freq(dim, theta) / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(dim, theta, params)
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, params)
    if rope_type == "longrope":
        return _longrope_inv_freq(dim, theta, positions, params)
    return _dynamic_inv_freq(dim, theta, positions, params)


def _llama3_inv_freq(dim: int, theta: float, params: Mapping[str, Any]) -> Tensor:
    """Llama 3.1: wavelengths longer than original / low_freq_factor are stretched by
    ``factor``, shorter than original / high_freq_factor kept, and blended in between."""
    inv_freq = _plain_inv_freq(dim, theta)
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    long_wavelength, short_wavelength = original / low, original / high
    kept_or_stretched = torch.where(wavelength > long_wavelength, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * kept_or_stretched / factor + smooth * kept_or_stretched
    in_between = ~(wavelength < short_wavelength) & ~(wavelength > long_wavelength)
    return torch.where(in_between, blended, kept_or_stretched)


def _yarn_inv_freq(dim: int, theta: float, params: Mapping[str, Any]) -> Tensor:
    """YaRN: dimensions that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), more than ``beta_fast`` times extrapolated
    (kept), with a linear ramp between; the attention factor scales cos/sin."""
    factor = float(params["factor"])
    original = float(params["original_max_position_embeddings"])

    def dimension_of(rotations: float) -> float:
        # The (fractional) dimension whose wavelength fits `rotations` times in `original`.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    first = dimension_of(float(params["beta_fast"]))
    last = dimension_of(float(params["beta_slow"]))
    if params.get("truncate", True):
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, dim - 1)
    if first == last:
        last += 0.001  # a one-point ramp would divide by zero
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - first) / (last - first)
    extrapolated_share = 1 - ramp.clamp(0, 1)
    wavelength_scale = theta ** _exponents(dim)
    kept = 1.0 / wavelength_scale
    interpolated = 1.0 / (factor * wavelength_scale)
    return interpolated * (1 - extrapolated_share) + kept * extrapolated_share


def _longrope_inv_freq(
    dim: int, theta: float, positions: Tensor, params: Mapping[str, Any]
) -> Tensor:
    """LongRoPE (Phi-3): per-dimension rescale factors, the short ones inside the original
    context and the long ones beyond it (position p decodes with seq_len p + 1)."""

    def scaled(factors: list[float]) -> Tensor:
        if len(factors) != dim // 2:
            raise ValueError(
                f"longrope factors: need {dim // 2} (rotary dim / 2), got {len(factors)}"
            )
        rescale = torch.tensor(factors, dtype=torch.float32, device="cpu")
        return 1.0 / (rescale * theta ** _exponents(dim))

    short, long = scaled(params["short_factor"]), scaled(params["long_factor"])
    beyond = positions >= int(params["original_max_position_embeddings"])
    return torch.where(beyond[:, None], long, short)


def _dynamic_inv_freq(
    dim: int, theta: float, positions: Tensor, params: Mapping[str, Any]
) -> Tensor:
    """Dynamic NTK: beyond the original length L, decoding seq_len s uses the base
    ``theta * (factor * s / L - (factor - 1)) ** (dim / (dim - 2))``."""
    if dim <= 2:
        raise ValueError(
            f"dynamic rope needs a rotary dim > 2 (its base exponent is dim / (dim - 2)), got {dim}"
        )
    factor = float(params["factor"])
    original = int(params["original_max_position_embeddings"])
    exponent = dim / (dim - 2)
    # Inside the original context HF keeps the frequencies it built at init (seq_len = L, in
    # python floats, so the base is theta up to rounding).
    init_base = theta * ((factor * original / original) - (factor - 1)) ** exponent
    inv_freq = _plain_inv_freq(dim, init_base).expand(len(positions), -1).clone()
    beyond = positions[positions >= original]
    if len(beyond):
        seq_len = (beyond + 1).to(torch.float32)
        growth = factor * seq_len / original - (factor - 1)
        base = theta * (growth.to(torch.float64) ** exponent).to(torch.float32)
        inv_freq[len(positions) - len(beyond) :] = _plain_inv_freq(dim, base[:, None])
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dimensions of q ``[T, H, D]`` and k ``[T, Hkv, D]``
    by their tokens' positions through ``ops.rotary_embedding``. The tables are non-persistent
    buffers: ``.to(device)`` moves them, ``state_dict`` leaves them out. Build it through a
    model's ``RopeCache`` so that layers with one rope share one table."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: Mapping[str, Any],
        ops: KernelOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops if ops is not None else get_kernel_ops("torch")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, params)
        self.max_position = max_position
        self.params = dict(params)
        device = torch.get_default_device()
        if device.type == "meta":
            # Shape-only construction (memory planning): nothing to compute.
            shape = (max_position, self.rotary_dim)
            cos = torch.empty(shape, dtype=torch.float32, device=device)
            sin = torch.empty(shape, dtype=torch.float32, device=device)
        else:
            # Built on the CPU whatever the target: the same table on every device and rank.
            cos, sin = (t.to(device) for t in rope_cos_sin(head_dim, max_position, params))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.rotary_dim == self.head_dim:
            return self.ops.rotary_embedding(positions, q, k, self.cos, self.sin)
        dim = self.rotary_dim
        q_rot, k_rot = self.ops.rotary_embedding(
            positions, q[..., :dim], k[..., :dim], self.cos, self.sin
        )
        return torch.cat((q_rot, q[..., dim:]), dim=-1), torch.cat((k_rot, k[..., dim:]), dim=-1)

    def extra_repr(self) -> str:
        return (
            f"rope_type={self.params['rope_type']}, head_dim={self.head_dim}, "
            f"rotary_dim={self.rotary_dim}, max_position={self.max_position}"
        )


class RopeCache:
    """The rotary embeddings of one model instance. ``get`` returns the same module for equal
    arguments, so every layer with the same rope shares one table (Gemma 3 has two: local and
    global). Not global state: each model owns its cache, built under one default device."""

    def __init__(self) -> None:
        self._embeddings: dict[tuple[Any, ...], RotaryEmbedding] = {}

    def get(
        self,
        head_dim: int,
        max_position: int,
        params: Mapping[str, Any],
        ops: KernelOps | None = None,
    ) -> RotaryEmbedding:
        ops = ops if ops is not None else get_kernel_ops("torch")
        key = (
            int(head_dim),
            int(max_position),
            freeze_rope_params(params),
            ops,
            str(torch.get_default_device()),
        )
        embedding = self._embeddings.get(key)
        if embedding is None:
            embedding = RotaryEmbedding(head_dim, max_position, params, ops)
            self._embeddings[key] = embedding
        return embedding

    def embeddings(self) -> list[RotaryEmbedding]:
        return list(self._embeddings.values())

    def buffer_bytes(self) -> int:
        """Bytes of all distinct cos/sin tables."""
        return sum(
            t.numel() * t.element_size() for e in self._embeddings.values() for t in (e.cos, e.sin)
        )

    def __len__(self) -> int:
        return len(self._embeddings)
