"""Suite-wide setup: offline, a per-checkout cache for built-in models, no idle Ray workers
started ahead, Triton's interpreter without CUDA.

Without CUDA, Triton kernels run on CPU tensors through the Triton interpreter. The switch is
read when a kernel module is imported (its ``@triton.jit`` decides then), so it is set here,
before any test module imports ``kernels.triton_*``. With CUDA the kernels compile for the GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.s3_server import S3Server

# Before anything imports transformers: never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LLM_CLUSTER_CACHE_DIR", os.path.join(os.getcwd(), ".cache", "llm-cluster"))
# Every Ray the suite starts (~30, in this process and in `cluster serve` subprocesses) would
# prestart one idle Python worker per core for its first driver; most are never used and each
# costs ~1 s of CPU on a 2-core machine. Actors start the workers they need either way.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def tiny_llama_dir() -> Path:
    """The built-in ``tiny-llama`` checkpoint's local directory (the suite's cache)."""
    from engine.builtin.catalog import resolve_model_source

    return resolve_model_source("builtin:tiny-llama")


@pytest.fixture(scope="module")
def tiny_llama_store(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Server]:
    """moto's S3 server holding ``tiny_llama_dir`` at ``s3://ckpts/tiny-llama``, with this
    process's environment pointing at it and the node's copies in a cache of their own."""
    from tests.s3_server import serving_checkpoint  # moto, only where a test asks for it

    cache = tmp_path_factory.mktemp("s3-cache")
    with serving_checkpoint(tiny_llama_dir, "ckpts", "tiny-llama", cache) as server:
        yield server


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
