"""What the loader reports while it loads: the bytes a rank goes through (from the safetensors
headers, before anything is read), its progress callback, and its log lines."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from engine.builtin.catalog import resolve_model_source
from engine.config import EngineConfig
from engine.models import get_model_class
from engine.worker.model_loader import LoadMeter, checkpoint_tensor_bytes, rank_read_bytes
from engine.worker.worker import Worker
from parallel.state import GroupCoordinator, ParallelContext


def _tensor_bytes_by_reading(path: Path) -> dict[str, int]:
    """Every tensor's bytes, from the tensors themselves (not the header's offsets)."""
    sizes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                sizes[name] = tensor.numel() * tensor.element_size()
    return sizes


def _model(path: Path, ctx: ParallelContext) -> tuple[torch.nn.Module, dict[str, Any]]:
    hf = json.loads((path / "config.json").read_text())
    with torch.device("meta"):
        return get_model_class(hf["architectures"][0])(hf, ctx), hf


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-phi3"])
def test_header_sizes_are_the_checkpoints_tensor_bytes(name: str) -> None:
    path = resolve_model_source(f"builtin:{name}")
    assert checkpoint_tensor_bytes(path) == _tensor_bytes_by_reading(path)


def test_a_single_worker_reports_every_tensor_byte_of_the_checkpoint() -> None:
    config = EngineConfig.from_kwargs(model="builtin:tiny-llama", device="cpu", num_kv_blocks=8)
    calls: list[tuple[int, int]] = []
    worker = Worker(config)
    worker.init_device()
    worker.load_model(progress=lambda read, total: calls.append((read, total)))
    total = sum(_tensor_bytes_by_reading(Path(config.model.model_path)).values())
    assert {t for _, t in calls} == {total}
    reads = [r for r, _ in calls]
    assert reads == sorted(reads) and reads[0] == 0 and reads[-1] == total
    assert len(calls) == len(checkpoint_tensor_bytes(config.model.model_path)) + 1


def test_pipeline_stages_split_the_checkpoint_bytes_between_them() -> None:
    path = resolve_model_source("builtin:tiny-llama")
    sizes = checkpoint_tensor_bytes(path)
    stages = []
    for rank in range(2):
        ctx = ParallelContext(pp=GroupCoordinator(rank=rank, size=2, ranks=(0, 1)))
        model, hf = _model(path, ctx)
        stages.append(rank_read_bytes(model, sizes, hf))
    assert all(0 < sum(s.values()) < sum(sizes.values()) for s in stages)
    # Each tensor is read by exactly one stage, whole.
    for name, nbytes in sizes.items():
        assert sorted((stages[0][name], stages[1][name])) == [0, nbytes], name


def test_a_tensor_parallel_rank_reads_its_share_of_each_tensor() -> None:
    path = resolve_model_source("builtin:tiny-llama")
    sizes = checkpoint_tensor_bytes(path)
    ctx = ParallelContext(tp=GroupCoordinator(rank=0, size=2, ranks=(0, 1)))
    model, hf = _model(path, ctx)
    shares = rank_read_bytes(model, sizes, hf)
    q = "model.layers.0.self_attn.q_proj.weight"
    norm = "model.layers.0.input_layernorm.weight"
    assert shares[q] == sizes[q] // 2  # sharded: half
    assert shares[norm] == sizes[norm]  # replicated: all of it


def test_the_meter_logs_every_10_percent_then_a_summary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    meter = LoadMeter(rank=5, total_bytes=100 << 30, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="llm_cluster.loader"):
        for _ in range(100):  # 1 GiB per second
            now[0] += 1.0
            meter.add(1 << 30)
        meter.finish()
    lines = [r.getMessage() for r in caplog.records]
    # Every 10 s or further 10 % (both at once here), none at 100 %: the summary says it.
    assert lines[0] == "rank 5: loading weights 10.00/100.00 GiB (10%), 10 s, 1024 MiB/s"
    assert lines[8] == "rank 5: loading weights 90.00/100.00 GiB (90%), 90 s, 1024 MiB/s"
    assert len(lines) == 9 + 1
    assert lines[-1] == "rank 5: loaded 100.00 GiB of weights in 100.0 s (1024 MiB/s)"


def test_a_short_load_logs_only_its_summary(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    meter = LoadMeter(rank=0, total_bytes=10 << 20, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="llm_cluster.loader"):
        for _ in range(10):
            now[0] += 0.1
            meter.add(1 << 20)
        meter.finish()
    assert [r.getMessage() for r in caplog.records] == [
        "rank 0: loaded 10.00 MiB of weights in 1.0 s (10 MiB/s)"
    ]
