"""KV cache writes and block moves for the Triton backend.

Same contracts as ``llm_kernels.attention`` (the torch reference): ``reshape_and_cache`` writes
each new token's K/V at its slot (``slot < 0`` = skip), ``copy_blocks`` copies whole blocks
inside every layer's cache (copy-on-write), ``swap_blocks`` moves blocks between a device
cache and the CPU swap space. A swap crosses devices, so it is a copy engine transfer, not a
kernel: gather the blocks, one transfer (pinned and asynchronous for host -> device), scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_kernels.attention_checks import check_block_mapping, check_cache_write_args, check_kv_cache
from llm_kernels.kv_quant import FP8_E4M3_MAX, as_storage, check_kv_scale, is_fp8
from llm_kernels.triton_common import check_triton_device
from llm_kernels.triton_fp8 import float_to_fp8e4m3_bits

__all__ = ["copy_blocks", "reshape_and_cache", "swap_blocks"]

# Elements of a block one copy program moves; a block is block_size * kv_heads * head_dim.
_COPY_CHUNK = 2048


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kv,
    num_kv_heads,
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    HAS_VALUE: tl.constexpr,
):
    """With KV_FP8, ``kv_ptr`` is the FP8 cache viewed as bytes and K/V are stored quantized:
    ``saturate(float32(x) / scale)`` rounded to e4m3 (``llm_kernels.kv_quant``). Without
    HAS_VALUE the cache is one latent plane and only the key is written."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    # A slot's K (or V) is num_kv_heads * HEAD_DIM contiguous elements.
    dst = slot * (num_kv_heads * HEAD_DIM) + heads[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + offs_d[None, :],
        mask=mask,
    )
    if KV_FP8:
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        k = float_to_fp8e4m3_bits(k).to(tl.uint8)
    tl.store(kv_ptr + dst, k, mask=mask)
    if HAS_VALUE:
        v = tl.load(
            value_ptr
            + token * stride_value_token
            + heads[:, None] * stride_value_head
            + offs_d[None, :],
            mask=mask,
        )
        if KV_FP8:
            v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
            v = float_to_fp8e4m3_bits(v).to(tl.uint8)
        tl.store(kv_ptr + stride_kv + dst, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(kv_ptr, mapping_ptr, stride_kv, block_numel, CHUNK: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)  # the plane: 0 = K (or the latent), 1 = V
    chunk = tl.program_id(2)
    src = tl.load(mapping_ptr + 2 * pair)
    dst = tl.load(mapping_ptr + 2 * pair + 1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    base = kv_ptr + half * stride_kv
    values = tl.load(base + src * block_numel + offs, mask=mask)
    tl.store(base + dst * block_numel + offs, values, mask=mask)


def reshape_and_cache(
    key: Tensor,
    value: Tensor | None,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` (strided views are
    fine as long as the last dim is contiguous) into ``kv_cache`` at ``slot_mapping``; an FP8
    cache stores them quantized with ``k_scale``/``v_scale``, others ignore the scales. A
    one-plane latent cache takes the key alone (``value`` None)."""
    check_cache_write_args(key, value, kv_cache, slot_mapping)
    fp8 = is_fp8(kv_cache)
    if fp8:
        k_scale = check_kv_scale("k_scale", k_scale)
        if value is not None:
            v_scale = check_kv_scale("v_scale", v_scale)
    _check_kv_cache("kv_cache", kv_cache)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    written = (("key", key),) if value is None else (("key", key), ("value", value))
    for name, t in written:
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if key.shape[0] == 0:
        return
    values = key if value is None else value  # never read without HAS_VALUE
    _reshape_and_cache_kernel[(key.shape[0],)](
        key,
        values,
        as_storage(kv_cache),
        slot_mapping,
        key.stride(0),
        key.stride(1),
        values.stride(0),
        values.stride(1),
        kv_cache.stride(0),
        num_kv_heads,
        float(k_scale) if fp8 else 1.0,
        float(v_scale) if fp8 and value is not None else 1.0,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        KV_FP8=fp8,
        FP8_MAX=FP8_E4M3_MAX,
        HAS_VALUE=value is not None,
    )


def copy_blocks(kv_caches: Sequence[Tensor], block_mapping: Tensor) -> None:
    """For every layer's cache (K/V or latent), copy block ``src`` into block ``dst`` for each
    row ``(src, dst)`` of ``block_mapping`` (int64 ``[K, 2]``).

    The copies run in parallel, so a block may not be both a source and a destination, and
    no block may be written twice (copy-on-write destinations are fresh blocks anyway).
    """
    check_block_mapping(block_mapping)
    if block_mapping.shape[0] == 0:
        return
    pairs = block_mapping.tolist()  # one small host read per step, to name bad ids clearly
    sources, destinations = {p[0] for p in pairs}, [p[1] for p in pairs]
    if len(set(destinations)) != len(destinations) or sources & set(destinations):
        raise ValueError(
            f"block_mapping: destinations must be distinct and never also a source, got {pairs}"
        )
    low, high = min(min(p) for p in pairs), max(max(p) for p in pairs)
    for layer, kv_cache in enumerate(kv_caches):
        name = f"kv_caches[{layer}]"
        _check_kv_cache(name, kv_cache)
        if low < 0 or high >= kv_cache.shape[1]:
            raise ValueError(
                f"block_mapping must be in [0, {kv_cache.shape[1]}) for {name}, "
                f"got values in [{low}, {high}]"
            )
    on_device: dict[torch.device, Tensor] = {}
    for kv_cache in kv_caches:
        mapping = on_device.get(kv_cache.device)
        if mapping is None:
            mapping = block_mapping.to(kv_cache.device).contiguous()
            on_device[kv_cache.device] = mapping
        block_numel = kv_cache[0, 0].numel()
        grid = (len(pairs), kv_cache.shape[0], triton.cdiv(block_numel, _COPY_CHUNK))
        _copy_blocks_kernel[grid](
            as_storage(kv_cache), mapping, kv_cache.stride(0), block_numel, CHUNK=_COPY_CHUNK
        )


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Copy block ``src_id`` of ``src`` into block ``dst_id`` of ``dst`` (every plane) for each
    row ``(src_id, dst_id)`` of ``block_mapping``; ``src``/``dst`` may be on different devices
    (device cache <-> CPU swap space).

    Ordering: a device -> host swap returns once the host copy is complete; a host -> device
    swap is queued on the current stream, so later kernels on that stream see the blocks.
    """
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 5 or t.shape[0] not in (1, 2):
            raise ValueError(
                f"{name} must have shape [2, num_blocks, block_size, num_kv_heads, head_dim] "
                f"(or [1, ...] for a latent cache), got {list(t.shape)}"
            )
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(
            f"dst has shape {list(dst.shape)} but src has {list(src.shape)}; they may differ "
            "only in num_blocks (dim 1)"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"dst has dtype {dst.dtype} but src has {src.dtype}")
    check_block_mapping(block_mapping)
    if block_mapping.shape[0] == 0:
        return
    mapping = block_mapping.cpu()
    for column, t, name in ((0, src, "src"), (1, dst, "dst")):
        ids = mapping[:, column]
        if int(ids.min()) < 0 or int(ids.max()) >= t.shape[1]:
            raise ValueError(
                f"block_mapping[:, {column}] must be in [0, {t.shape[1]}) for {name}, "
                f"got values in [{int(ids.min())}, {int(ids.max())}]"
            )
    # Bytes for an FP8 cache: index_copy_ has no float8 kernel on CPU.
    src, dst = as_storage(src), as_storage(dst)
    blocks = src.index_select(1, mapping[:, 0].to(src.device))
    if src.device != dst.device:
        if dst.device.type == "cuda" and src.device.type == "cpu":
            staging = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
            blocks = staging.copy_(blocks).to(dst.device, non_blocking=True)
        else:
            blocks = blocks.to(dst.device)
    dst.index_copy_(1, mapping[:, 1].to(dst.device), blocks)


def _check_kv_cache(name: str, kv_cache: Tensor) -> None:
    check_kv_cache(name, kv_cache)
    check_triton_device(kv_cache.device, name)
