"""Suite-wide setup: offline, a per-checkout cache for built-in models, Triton's interpreter
without CUDA.

Without CUDA, Triton kernels run on CPU tensors through the Triton interpreter. The switch is
read when a kernel module is imported (its ``@triton.jit`` decides then), so it is set here,
before any test module imports ``kernels.triton_*``. With CUDA the kernels compile for the GPU.
"""

from __future__ import annotations

import os

# Before anything imports transformers: never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LLM_CLUSTER_CACHE_DIR", os.path.join(os.getcwd(), ".cache", "llm-cluster"))

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("nixl" in item.keywords for item in items):
        _skip_nixl_without_nixl(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _skip_nixl_without_nixl(items: list[pytest.Item]) -> None:
    from engine.kv_transfer.nixl import nixl_api

    try:
        nixl_api()
    except ImportError as exc:
        skip = pytest.mark.skip(reason=f"NIXL cannot be imported: {exc}")
        for item in items:
            if "nixl" in item.keywords:
                item.add_marker(skip)
