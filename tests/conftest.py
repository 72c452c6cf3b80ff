"""Suite-wide setup: offline, a per-session cache for built-in models, few threads."""

from __future__ import annotations

import os

# Before anything imports transformers / torch: never reach a model hub; keep the 2-core CI
# machine from oversubscribing when several engines run in one process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LLM_CLUSTER_CACHE_DIR", os.path.join(os.getcwd(), ".cache", "llm-cluster"))

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
