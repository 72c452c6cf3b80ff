"""GPU tier: decode CUDA graphs with tensor and pipeline parallelism replay what the eager step
computes, token for token, and the KV cache sized through the CUDA memory probe fits.

Multi-GPU cases run one process per GPU (NCCL allows one rank per device) and need no Ray:
each process drives its ``Worker`` with hand-made ``ExecuteModelRequest``s, and the driver
(TP rank 0 of the last stage) broadcasts its sampled tokens so every rank builds the next
step's request, as the head would. In the CPU tier the same harness runs TP 2 and PP 2 on gloo
with the graphs' data path run eagerly (``DecodeBucketRunner``): all but the capture.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from tests.engine.spawned_ranks import greedy_steps, rank_config, rendezvous, run_ranks

MODEL = "builtin:tiny-llama"
PROMPTS = [[5, 9, 21, 7], [100, 3, 3, 8, 40, 41, 2], [17, 18], [1, 2, 3, 4, 5, 6], [30] * 11]
DECODE_STEPS = 12
CPU_DECODE_STEPS = 4  # the Triton interpreter is slow; a few steps still pass bucket 8
BLOCKS_PER_REQUEST = 4  # 64 tokens: prompt + decode steps fit


def _config(
    tp: int, pp: int, rank: int = 0, device: str = "cuda", backend: str = "triton", **kwargs: Any
) -> EngineConfig:
    return rank_config(
        rank,
        model=MODEL,
        device=device,
        dtype="float32",
        attention_backend=backend,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_seqs=8,
        max_model_len=128,
        **kwargs,
    )


def _rank_main(
    rank: int, ports: Any, results: Any, tp: int, pp: int, device: str, bucket_runner: bool
) -> None:
    """One rank: greedy decode with graphs (or, ``bucket_runner`` on CPU, the graphs' data path
    run eagerly: static buffers, padded buckets), then with plain eager steps."""
    try:
        from engine.worker.worker import Worker

        backend = "triton" if device == "cuda" or bucket_runner else "torch"
        extra = {} if device == "cuda" else {"max_num_batched_tokens": 32}
        # On CPU a fixed fake probe lets every rank run the sizing path's collectives too.
        probe = None if device == "cuda" else _FixedProbe()
        worker = Worker(
            _config(tp, pp, rank, device, backend, num_kv_blocks=64, **extra), memory_probe=probe
        )
        worker.init_device(rank)
        if tp * pp > 1:
            rendezvous(worker, rank, tp * pp, ports)
        worker.load_model()
        # Warm-up chain, a profiling step with the stage's all-reduces, graph-pool measurement.
        kv_budget = worker.profile_kv_budget().kv_cache if probe is not None else None
        worker.initialize_cache(64, 0)  # captures every bucket, collectively
        runner = worker.runner
        if bucket_runner:
            runner.graph_runner = make_bucket_runner(runner)
        graphs = runner.graph_runner
        replays = 0
        if graphs is not None:
            run = graphs.run

            def counting_run(*args: Any, **kwargs: Any) -> Any:
                nonlocal replays
                replays += 1
                return run(*args, **kwargs)

            graphs.run = counting_run  # type: ignore[method-assign]
        driver = (pp - 1) * tp
        steps = DECODE_STEPS if device == "cuda" else CPU_DECODE_STEPS
        run_steps = functools.partial(
            greedy_steps, worker, PROMPTS, steps, blocks_per_request=BLOCKS_PER_REQUEST,
            driver_rank=driver,
        )  # fmt: skip
        replayed = run_steps(prefix="graph-")
        runner.graph_runner = None  # every rank at once: the same step runs eagerly everywhere
        eager = run_steps(prefix="eager-")
        runner.graph_runner = graphs
        worker.shutdown()
        results.put(
            (
                rank,
                {"replayed": replayed, "eager": eager, "replays": replays, "kv_budget": kv_budget},
            )
        )
    except BaseException as exc:
        results.put((rank, repr(exc)))


class _FixedProbe:
    """A device with 1 GiB, a quarter in use, whose torch figures never move."""

    def mem_get_info(self) -> tuple[int, int]:
        return 3 << 28, 1 << 30

    def max_memory_allocated(self) -> int:
        return 1 << 20

    def memory_reserved(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def make_bucket_runner(runner: Any) -> Any:
    """A decode-bucket runner over ``runner``'s model (graphs or not: the same data path)."""
    from engine.worker.cuda_graphs import DecodeBucketRunner

    config = runner.config
    return DecodeBucketRunner(
        runner.model,
        runner.device,
        block_size=config.cache.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        num_kv_blocks=64,
        hidden_size=None if runner.ctx.pp.is_first else config.model.hf_config["hidden_size"],
        dtype=config.model.torch_dtype,
    )


def _run_ranks(
    tp: int, pp: int, device: str = "cuda", bucket_runner: bool = False
) -> dict[int, dict[str, Any]]:
    return run_ranks(_rank_main, tp * pp, tp, pp, device, bucket_runner, timeout_s=600)


def _needs_gpus(n: int) -> pytest.MarkDecorator:
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(available < n, reason=f"needs {n} CUDA devices, {available} here")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tp", "pp"),
    [
        pytest.param(2, 1, marks=_needs_gpus(2), id="tp2"),
        pytest.param(1, 2, marks=_needs_gpus(2), id="pp2"),
        pytest.param(2, 2, marks=_needs_gpus(4), id="tp2-pp2"),
    ],
)
def test_gpu_parallel_graph_replay_equals_eager_token_for_token(tp: int, pp: int) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"
    ranks = _run_ranks(tp, pp)
    driver = ranks[(pp - 1) * tp]
    assert driver["replayed"] == driver["eager"]
    # Every rank replayed its stage's graph for every decode step (5 requests: bucket 8).
    assert [ranks[r]["replays"] for r in range(tp * pp)] == [DECODE_STEPS] * (tp * pp)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_graph_data_path_equals_eager_with_tp_and_pp_on_cpu(tp: int, pp: int) -> None:
    # Everything a replay does but the capture, on gloo through the Triton interpreter: the
    # decode steps go through the static buffers padded to bucket 8 (all-reduces over padding
    # rows with TP; static hidden/residual filled from the stage hand-off with PP).
    ranks = _run_ranks(tp, pp, device="cpu", bucket_runner=True)
    driver = ranks[(pp - 1) * tp]
    assert driver["replayed"] == driver["eager"]
    assert all(len(t) == CPU_DECODE_STEPS + 1 for t in driver["eager"])
    assert [ranks[r]["replays"] for r in range(tp * pp)] == [CPU_DECODE_STEPS] * (tp * pp)
    # Every rank sized its KV cache (0.9 GiB share - 1 MiB "weights"; the quarter in use at
    # start is others' and the context's, outside the share).
    assert {ranks[r]["kv_budget"] for r in range(tp * pp)} == {int(0.9 * (1 << 30)) - (1 << 20)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_single_worker_graph_replay_equals_eager_and_counts_replays() -> None:
    results: dict[int, Any] = {}

    class Queue:
        def put(self, item: Any) -> None:
            results[item[0]] = item[1]

    _rank_main(0, None, Queue(), 1, 1, "cuda", False)
    out = results[0]
    assert not isinstance(out, str), out
    assert out["replayed"] == out["eager"]
    assert out["replays"] == DECODE_STEPS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kv_cache_sized_by_the_cuda_probe_stays_within_the_utilization_share() -> None:
    from engine.worker.worker import Worker

    worker = Worker(_config(1, 1, gpu_memory_utilization=0.5, max_num_batched_tokens=1024))
    worker.init_device(0)
    worker.load_model()
    num_blocks, _ = worker.determine_num_available_blocks()
    budget = worker.kv_budget
    assert budget is not None
    assert budget.cuda_graph_pool > 0  # measured by capturing every bucket
    assert budget.activation_peak > 0
    worker.initialize_cache(num_blocks, 0)
    tokens = greedy_steps(
        worker, PROMPTS, DECODE_STEPS, prefix="sized-", blocks_per_request=BLOCKS_PER_REQUEST
    )
    assert all(len(t) == DECODE_STEPS + 1 for t in tokens)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    # What this worker took since its start (the CUDA context and others' memory were in use
    # then) fits the share it was given (2% allocator slack).
    assert total - free - budget.used_at_start <= budget.requested * 1.02, budget.describe()
    worker.shutdown()
