"""A CPU KV pool reads as zeros and commits its memory only where it is written."""

from __future__ import annotations

import torch

from engine.worker.zeroed_memory import zeroed_tensor

MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_equals_torch_zeros_in_every_cache_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        shape = (2, 3, 16, 2, 8)
        cache = zeroed_tensor(shape, dtype, torch.device("cpu"))
        assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
        assert torch.equal(cache.float(), torch.zeros(shape))
        cache[1, 2, 15] = 1.0  # writable, and a write lands where it is written
        assert cache.float().sum() == 16


def test_pages_are_committed_on_first_write_and_released_with_the_tensor() -> None:
    before = _rss()
    cache = zeroed_tensor((2, 4096, 16, 4, 64), torch.bfloat16, torch.device("cpu"))  # 64 MiB
    assert _rss() - before < 8 * MIB
    cache[:, :1024].fill_(1.0)  # a quarter of the blocks
    written = _rss() - before
    assert 12 * MIB < written < 24 * MIB  # 16 MiB
    del cache
    assert _rss() - before < 8 * MIB


def test_an_empty_cache_is_an_ordinary_tensor() -> None:
    cache = zeroed_tensor((2, 0, 16, 1, 8), torch.float32, torch.device("cpu"))
    assert cache.shape == (2, 0, 16, 1, 8)
