"""KV-cache sizing: the budget arithmetic against hand-computed figures (gpu_memory_utilization
is the instance's own share: memory others hold does not count, but must leave the share free),
and the worker's whole sizing path (warm-up, a real profiling forward pass, graph-pool
measurement) on CPU with a fake memory probe standing in for the CUDA driver."""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

import pytest
import torch

import engine.worker.model_runner as model_runner_module
from engine.config import EngineConfig
from engine.worker.kv_sizing import (
    KVBudget,
    MemorySnapshot,
    check_start_memory,
    compute_kv_budget,
)
from engine.worker.worker import Worker

GiB = 1 << 30
MiB = 1 << 20


def snapshot(total: int, used: int, torch_reserved: int = 0) -> MemorySnapshot:
    return MemorySnapshot(total=total, free=total - used, torch_reserved=torch_reserved)


def budget(**overrides: object) -> KVBudget:
    """An 80 GiB card that nothing else uses: start with 0.5 GiB in use (the CUDA context),
    end with 16 GiB of weights reserved by torch and 0.5 GiB more outside torch (NCCL)."""
    args: dict[str, object] = {
        "start": snapshot(80 * GiB, GiB // 2),
        "end": snapshot(80 * GiB, GiB // 2 + 16 * GiB + GiB // 2, torch_reserved=16 * GiB),
        "gpu_memory_utilization": 0.9,
        "weights": 16 * GiB,
        "profile_peak": 16 * GiB + 3 * GiB + 64 * MiB,
        "profile_kv_cache": 64 * MiB,
        "cuda_graph_pool": 0,
    }
    args.update(overrides)
    return compute_kv_budget(**args)  # type: ignore[arg-type]


def test_budget_is_utilization_share_minus_this_workers_own_usage() -> None:
    b = budget()
    # 72 - 0.5 (NCCL) - 16 (weights) - 3 (activations) = 52.5 GiB; the 0.5 GiB in use at
    # start (the CUDA context) is outside the share, as in vLLM v1.
    assert b.requested == int(80 * GiB * 0.9)
    assert (b.used_at_start, b.non_torch, b.weights) == (GiB // 2, GiB // 2, 16 * GiB)
    assert b.activation_peak == 3 * GiB
    assert b.kv_cache == int(80 * GiB * 0.9) - GiB // 2 - 16 * GiB - 3 * GiB


def test_profile_kv_cache_does_not_count_as_activations() -> None:
    assert budget(profile_kv_cache=0).activation_peak == 3 * GiB + 64 * MiB


def test_graph_pool_is_taken_out_of_the_kv_budget() -> None:
    assert budget(cuda_graph_pool=700 * MiB).kv_cache == budget().kv_cache - 700 * MiB


def test_communicator_buffers_grown_after_start_are_reserved() -> None:
    # NCCL allocated 2 GiB outside torch between init_device and the end of profiling.
    end = snapshot(80 * GiB, GiB // 2 + 16 * GiB + 2 * GiB, torch_reserved=16 * GiB)
    b = budget(end=end)
    assert b.non_torch == 2 * GiB
    assert b.kv_cache == budget().kv_cache - (2 * GiB - GiB // 2)


def shared_device_budget(first_instance_bytes: int) -> KVBudget:
    """The second instance on an 80 GiB card at utilization 0.4, started while the first
    instance holds ``first_instance_bytes`` (its context, weights and KV cache): a 0.5 GiB
    context, 4 GiB of weights, 0.25 GiB outside torch and a 1 GiB activation peak of its own."""
    ours_at_start = GiB // 2
    start = snapshot(80 * GiB, first_instance_bytes + ours_at_start)
    end = snapshot(
        80 * GiB,
        first_instance_bytes + ours_at_start + 4 * GiB + GiB // 4,
        torch_reserved=4 * GiB,
    )
    return budget(
        start=start,
        end=end,
        gpu_memory_utilization=0.4,
        weights=4 * GiB,
        profile_peak=5 * GiB + 64 * MiB,
    )


def test_second_instance_on_a_shared_device_gets_its_own_share() -> None:
    # 32 GiB share - 0.25 GiB (its non-torch growth) - 4 GiB (weights) - 1 GiB (activations),
    # whatever the first instance holds: nothing on an empty card, or its whole 0.4 share.
    expected = int(80 * GiB * 0.4) - GiB // 4 - 4 * GiB - GiB
    alone = shared_device_budget(0)
    assert alone.kv_cache == expected
    for first in (GiB // 2 + 4 * GiB, int(80 * GiB * 0.4), 47 * GiB):
        second = shared_device_budget(first)
        assert second.used_at_start == first + GiB // 2  # reported, not counted
        assert second.non_torch == GiB // 4
        assert second.kv_cache == expected
    # The second instance's share was free when it started: 80 - 47 - 0.5 >= 32 GiB.
    check_start_memory(snapshot(80 * GiB, 47 * GiB + GiB // 2), 0.4)


def test_start_is_refused_when_less_than_the_share_is_free() -> None:
    # 49 GiB held by others: 31 GiB free < 0.4 x 80 = 32 GiB.
    start = snapshot(80 * GiB, 49 * GiB)
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization=0\.4 ") as info:
        check_start_memory(start, 0.4)
    message = str(info.value)
    for figure in ("32.00 GiB of the device's 80.00 GiB", "31.00 GiB is free", "49.00 GiB in use"):
        assert figure in message
    assert "at most 0.38" in message  # 31/80 = 0.3875, rounded down
    # Exactly the share free is enough.
    check_start_memory(snapshot(80 * GiB, 80 * GiB - int(80 * GiB * 0.4)), 0.4)


def test_torch_memory_held_at_start_is_not_counted_twice() -> None:
    # 1 GiB torch already reserved at start is part of the weights (allocated), not "in use".
    start = snapshot(80 * GiB, GiB // 2 + GiB, torch_reserved=GiB)
    assert budget(start=start).kv_cache == budget().kv_cache


def test_utilization_scales_the_share_of_the_card() -> None:
    assert budget(gpu_memory_utilization=0.5).kv_cache == budget().kv_cache - int(80 * GiB * 0.4)


def test_blocks_are_the_budget_divided_by_the_block_size() -> None:
    b = budget()
    assert b.num_blocks(2 * MiB) == b.kv_cache // (2 * MiB)


def test_an_empty_budget_is_refused_naming_the_figures() -> None:
    b = budget(gpu_memory_utilization=0.2)  # 16 GiB share < 16 GiB weights + the rest
    assert b.kv_cache < 0
    with pytest.raises(RuntimeError, match="no device memory left for the KV cache") as info:
        b.check(block_bytes=2 * MiB, blocks_per_sequence=8, max_model_len=128)
    message = str(info.value)
    for figure in ("total 80.00 GiB", "weights 16.00 GiB", "activation peak 3.00 GiB"):
        assert figure in message


def test_a_budget_below_one_max_model_len_sequence_is_refused() -> None:
    # 52 GiB left; a 128k-token sequence at 1 MiB per 16-token block needs 8000 MiB... x8.
    b = budget()
    with pytest.raises(RuntimeError, match="smaller than one sequence of max_model_len=131072"):
        b.check(block_bytes=8 * MiB, blocks_per_sequence=8192, max_model_len=131072)
    b.check(block_bytes=2 * MiB, blocks_per_sequence=8192, max_model_len=131072)


def test_utilization_outside_zero_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        budget(gpu_memory_utilization=1.5)


# ---- the worker, end to end on CPU --------------------------------------------------------

MAX_BATCHED = 256
ACTIVATION_PER_TOKEN = 1 * MiB


class FakeMemoryProbe:
    """A device whose figures the test scripts: ``allocated``/``reserved`` stand for torch's
    allocator, ``used_outside_torch`` for contexts, NCCL and other processes."""

    def __init__(self, total: int, used_outside_torch: int) -> None:
        self.total = total
        self.used_outside_torch = used_outside_torch
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.resets = 0

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used_outside_torch - self.reserved, self.total

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_reserved(self) -> int:
        return self.reserved

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated
        self.resets += 1

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def kv_bytes(runner: model_runner_module.ModelRunner) -> int:
    return sum(c.numel() * c.element_size() for c in runner.cache_engine.kv_caches)


def sized_worker(probe: FakeMemoryProbe, **engine_args: object) -> Worker:
    config = EngineConfig.from_kwargs(
        model="builtin:tiny-llama",
        device="cpu",
        max_num_batched_tokens=MAX_BATCHED,
        max_num_seqs=8,
        max_model_len=512,
        **engine_args,
    )
    worker = Worker(config, memory_probe=probe)
    worker.init_device()  # start snapshot
    worker.load_model()
    weights = worker.parameter_bytes()
    probe.allocated = probe.reserved = probe.peak = weights
    probe.used_outside_torch += 300 * MiB  # kernel modules, communicator buffers

    def record_peak(module: torch.nn.Module, args: tuple, output: object) -> None:
        # What a real allocator would see: weights + the profile's KV cache + activations.
        num_tokens = args[0].shape[0]
        peak = probe.allocated + kv_bytes(worker.runner) + num_tokens * ACTIVATION_PER_TOKEN
        probe.peak = max(probe.peak, peak)
        worker.profiled_tokens = num_tokens  # type: ignore[attr-defined]

    worker.runner.model.register_forward_hook(record_peak)
    return worker


def test_worker_sizes_kv_cache_from_a_profiling_forward_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = FakeMemoryProbe(total=4 * GiB, used_outside_torch=512 * MiB)
    worker = sized_worker(probe, gpu_memory_utilization=0.5)
    with caplog.at_level(logging.INFO, logger="llm_cluster.worker"):
        num_blocks, _ = worker.determine_num_available_blocks()
    weights = worker.parameter_bytes()
    # The 512 MiB in use at start (context, other processes) is outside the 2 GiB share.
    expected_budget = 2 * GiB - 300 * MiB - weights - MAX_BATCHED * ACTIVATION_PER_TOKEN
    assert worker.profiled_tokens == MAX_BATCHED  # type: ignore[attr-defined]
    assert worker.kv_budget is not None
    assert worker.kv_budget.activation_peak == MAX_BATCHED * ACTIVATION_PER_TOKEN
    assert worker.kv_budget.kv_cache == expected_budget
    assert num_blocks == expected_budget // worker.kv_block_bytes()
    assert worker.runner.cache_engine.kv_caches[0].shape[1] == 0  # the profile's cache is gone
    (line,) = [r.getMessage() for r in caplog.records if "KV cache sizing" in r.getMessage()]
    assert f"-> {num_blocks} blocks" in line and "activation peak 256.0 MiB" in line


def test_worker_refuses_a_budget_smaller_than_one_sequence() -> None:
    probe = FakeMemoryProbe(total=4 * GiB, used_outside_torch=512 * MiB)
    worker = sized_worker(probe, gpu_memory_utilization=0.1)  # 409 MiB share < 556 MiB + weights
    with pytest.raises(RuntimeError, match=r"no device memory left for the KV cache.*weights"):
        worker.determine_num_available_blocks()


def test_worker_on_a_shared_device_sizes_as_if_alone() -> None:
    # Another instance already holds 1.5 GiB of the 4 GiB card; this one's 1.6 GiB share is
    # free (2 GiB), and its cache is what it would get on a card of its own.
    alone = sized_worker(
        FakeMemoryProbe(total=4 * GiB, used_outside_torch=512 * MiB), gpu_memory_utilization=0.4
    )
    shared = sized_worker(
        FakeMemoryProbe(total=4 * GiB, used_outside_torch=512 * MiB + 3 * GiB // 2),
        gpu_memory_utilization=0.4,
    )
    alone.determine_num_available_blocks()
    num_blocks, _ = shared.determine_num_available_blocks()
    assert alone.kv_budget is not None and shared.kv_budget is not None
    expected = (
        int(4 * GiB * 0.4)
        - 300 * MiB
        - shared.parameter_bytes()
        - MAX_BATCHED * ACTIVATION_PER_TOKEN
    )
    assert shared.kv_budget.kv_cache == alone.kv_budget.kv_cache == expected
    assert num_blocks == expected // shared.kv_block_bytes()


def test_worker_refuses_at_start_when_its_share_is_not_free() -> None:
    # Others hold 2.5 GiB of 4: 1.5 GiB free < 0.4 x 4 GiB; refused before the weights load.
    config = EngineConfig.from_kwargs(
        model="builtin:tiny-llama", device="cpu", gpu_memory_utilization=0.4
    )
    worker = Worker(
        config, memory_probe=FakeMemoryProbe(total=4 * GiB, used_outside_torch=5 * GiB // 2)
    )
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization=0\.4 asks for 1\.60 GiB of "
                       r"the device's 4\.00 GiB, but only 1\.50 GiB is free"):  # fmt: skip
        worker.init_device()
    # With an explicit num_kv_blocks the share is not used, and nothing is refused.
    explicit = Worker(
        EngineConfig.from_kwargs(
            model="builtin:tiny-llama", device="cpu", gpu_memory_utilization=0.4, num_kv_blocks=8
        ),
        memory_probe=FakeMemoryProbe(total=4 * GiB, used_outside_torch=5 * GiB // 2),
    )
    explicit.init_device()


def test_graph_pool_measured_by_capture_is_reserved_before_sizing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = 96 * MiB
    probe = FakeMemoryProbe(total=4 * GiB, used_outside_torch=512 * MiB)
    events: list[str] = []

    class FakeGraphRunner:
        """Stands in for the CUDA graphs: capturing reserves ``pool`` bytes in torch's pool."""

        def __init__(self, model: object, device: object, **kwargs: object) -> None:
            self.graphs: dict[int, object] = {}
            events.append(f"graphs over {kwargs['num_kv_blocks']} blocks")

        def capture_all(self) -> None:
            probe.reserved += pool
            self.graphs = {1: object()}
            events.append("capture")

        @property
        def num_graphs(self) -> int:
            return len(self.graphs)

        def release(self) -> None:
            if self.graphs:
                probe.reserved -= pool
                events.append("release")

    monkeypatch.setattr(model_runner_module, "DecodeCudaGraphRunner", FakeGraphRunner)
    monkeypatch.setattr(model_runner_module.ModelRunner, "uses_cuda_graphs", lambda self: True)
    with_graphs = sized_worker(probe, gpu_memory_utilization=0.5)
    with_graphs.determine_num_available_blocks()
    assert events[-3:] == ["graphs over 16 blocks", "capture", "release"]
    assert with_graphs.kv_budget is not None
    assert with_graphs.kv_budget.cuda_graph_pool == pool
    monkeypatch.undo()
    eager = sized_worker(
        FakeMemoryProbe(total=4 * GiB, used_outside_torch=512 * MiB), gpu_memory_utilization=0.5
    )
    eager.determine_num_available_blocks()
    assert eager.kv_budget is not None
    assert with_graphs.kv_budget.kv_cache == eager.kv_budget.kv_cache - pool


def test_explicit_num_kv_blocks_skips_profiling() -> None:
    probe = FakeMemoryProbe(total=4 * GiB, used_outside_torch=0)
    worker = sized_worker(probe, num_kv_blocks=17)
    assert worker.determine_num_available_blocks()[0] == 17
    assert probe.resets == 0


def test_cpu_worker_without_a_probe_sizes_by_cpu_kv_cache_space() -> None:
    config = EngineConfig.from_kwargs(
        model="builtin:tiny-llama", device="cpu", max_num_seqs=2, max_model_len=64
    )
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    assert worker.memory_probe is None
    # 2 sequences x 64 tokens / 16 per block: what the scheduler can fill.
    assert worker.determine_num_available_blocks()[0] == 8


# ---- two instances on one real GPU (gpu tier) -----------------------------------------------


def _cuda_worker(gpu_memory_utilization: float) -> Worker:
    config = EngineConfig.from_kwargs(
        model="builtin:tiny-llama",
        device="cuda",
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
    )
    return Worker(config)


def _hold_an_instance(gpu_memory_utilization: float, out: Any, done: Any) -> None:
    """A child process: size and allocate one instance's cache, report its budget, and hold
    the memory until ``done``."""
    try:
        worker = _cuda_worker(gpu_memory_utilization)
        worker.init_device(0)
        worker.load_model()
        num_blocks, _ = worker.determine_num_available_blocks()
        worker.initialize_cache(num_blocks, 0)
        assert worker.kv_budget is not None
        torch.cuda.synchronize()
        out.put(worker.kv_budget.kv_cache)
        done.wait(600)
    except BaseException as exc:
        out.put(repr(exc))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_second_instance_on_the_device_sizes_its_own_share() -> None:
    ctx = multiprocessing.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    first = ctx.Process(target=_hold_an_instance, args=(0.3, out, done))
    first.start()
    try:
        first_kv = out.get(timeout=600)
        assert not isinstance(first_kv, str), first_kv
        # The first holds ~0.3 of the GPU: 0.75 more is not free, and is refused at once.
        with pytest.raises(RuntimeError, match=r"gpu_memory_utilization=0\.75 asks for"):
            _cuda_worker(0.75).init_device(0)
        second = _cuda_worker(0.3)
        second.init_device(0)
        second.load_model()
        num_blocks, _ = second.determine_num_available_blocks()
        budget = second.kv_budget
        assert budget is not None
        assert budget.used_at_start > int(budget.total * 0.25)  # the first instance's memory
        # Same model and settings: the same cache as the first, whatever the first holds
        # (within 5%: kernel modules and allocator rounding differ a little between processes).
        assert abs(budget.kv_cache - first_kv) <= 0.05 * first_kv, budget.describe()
        second.initialize_cache(num_blocks, 0)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        # This instance's growth since its start fits its share (2% allocator slack).
        grown = total - free - budget.used_at_start
        assert grown <= budget.requested * 1.02, budget.describe()
        second.shutdown()
    finally:
        done.set()
        first.join(60)
