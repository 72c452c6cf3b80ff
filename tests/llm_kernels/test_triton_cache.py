"""llm_kernels.triton_cache against the torch cache ops (the reference), through the Triton
interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

from llm_kernels import attention, triton_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_cache(num_blocks: int = 6, dtype: torch.dtype = torch.float32, head_dim: int = 80):
    return torch.randn(2, num_blocks, 16, 2, head_dim).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_the_same_slots_as_reference(dtype):
    kv = random_cache(dtype=dtype)
    expected = kv.clone()
    key, value = torch.randn(5, 2, 80).to(dtype), torch.randn(5, 2, 80).to(dtype)
    slots = torch.tensor([5, -1, 40, 95, 16])  # one skipped token, slots in shuffled blocks
    triton_cache.reshape_and_cache(key, value, kv, slots)
    attention.reshape_and_cache(key, value, expected, slots)
    assert torch.equal(kv, expected)


def test_reshape_and_cache_reads_strided_key_and_value_views():
    kv = random_cache()
    expected = kv.clone()
    qkv = torch.randn(3, 6, 80)  # [tokens, q heads (2) + k heads (2) + v heads (2), head_dim]
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([0, 17, 33])
    triton_cache.reshape_and_cache(key, value, kv, slots)
    attention.reshape_and_cache(key, value, expected, slots)
    assert torch.equal(kv, expected)


def test_reshape_and_cache_rejects_int32_slots():
    kv = random_cache()
    key = torch.randn(2, 2, 80)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        triton_cache.reshape_and_cache(key, key, kv, torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_every_layer_like_reference(dtype):
    layers = [random_cache(dtype=dtype) for _ in range(2)]
    expected = [layer.clone() for layer in layers]
    mapping = torch.tensor([[0, 3], [5, 1], [2, 4]])
    triton_cache.copy_blocks(layers, mapping)
    attention.copy_blocks(expected, mapping)
    for got, want in zip(layers, expected, strict=True):
        assert torch.equal(got, want)


def test_copy_blocks_rejects_a_destination_that_is_also_a_source():
    with pytest.raises(ValueError, match="never also a source"):
        triton_cache.copy_blocks([random_cache()], torch.tensor([[0, 1], [1, 2]]))


def test_copy_blocks_rejects_block_ids_out_of_range():
    with pytest.raises(ValueError, match=r"must be in \[0, 6\) for kv_caches\[0\]"):
        triton_cache.copy_blocks([random_cache()], torch.tensor([[0, 6]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_moves_blocks_like_reference(dtype):
    device_cache = random_cache(dtype=dtype)
    swap_space = torch.zeros(2, 4, 16, 2, 80, dtype=dtype)
    expected = swap_space.clone()
    mapping = torch.tensor([[5, 0], [0, 3]])
    triton_cache.swap_blocks(device_cache, swap_space, mapping)
    attention.swap_blocks(device_cache, expected, mapping)
    assert torch.equal(swap_space, expected)


def test_swap_blocks_rejects_mismatched_block_shapes():
    with pytest.raises(ValueError, match="may differ only in num_blocks"):
        triton_cache.swap_blocks(
            random_cache(head_dim=80), random_cache(head_dim=64), torch.tensor([[0, 0]])
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_swap_out_and_back_in_restores_blocks():
    device_cache = torch.randn(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    swap_space = torch.zeros(2, 32, 16, 8, 128, dtype=torch.bfloat16, pin_memory=True)
    original = device_cache[:, [3, 40]].clone()
    triton_cache.swap_blocks(device_cache, swap_space, torch.tensor([[3, 7], [40, 0]]))
    device_cache[:, [3, 40]] = 0
    triton_cache.swap_blocks(swap_space, device_cache, torch.tensor([[7, 10], [0, 11]]))
    assert torch.equal(device_cache[:, [10, 11]], original)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_reshape_and_cache_and_copy_blocks_match_reference():
    kv = torch.randn(2, 512, 16, 8, 128, dtype=torch.float16, device="cuda")
    expected = kv.clone()
    key, value = (torch.randn(300, 8, 128, dtype=torch.float16, device="cuda") for _ in "kv")
    slots = torch.randperm(512 * 16, device="cuda")[:300]
    triton_cache.reshape_and_cache(key, value, kv, slots)
    attention.reshape_and_cache(key, value, expected, slots)
    mapping = torch.tensor([[1, 500], [2, 501], [3, 502]], device="cuda")
    triton_cache.copy_blocks([kv], mapping)
    attention.copy_blocks([expected], mapping)
    assert torch.equal(kv, expected)
