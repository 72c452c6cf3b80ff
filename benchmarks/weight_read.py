"""Weight-read throughput against the disk's own sequential read rate, page cache dropped.

Each round reads the same checkpoint with every method, each after ``sync; echo 3 >
/proc/sys/vm/drop_caches`` (root only; without it the runs read from the page cache and the
report says so), in an order that rotates from round to round:

- ``dd``: ``dd if=FILE of=/dev/null bs=16M``, file by file: the disk's sequential rate;
- ``safetensors``: ``safe_open`` + ``get_slice(name)[:]`` for every tensor (mmap, one thread);
- ``reader``: ``engine.worker.checkpoint_reader`` (parallel preadv ahead), tensors only;
- ``engine``: the engine's weight load into a model (``load_weights``: read, cast, copy into
  the parameters), without the CPU GEMM repack, through the reader;
- ``engine-mmap``: the same load fed by safetensors' lazy slices (the loader before the
  reader), for the before/after;
- ``runai``, ``fastsafetensors``: those loaders' CPU paths, where importable, and
  ``engine-runai``: the engine's load fed by the Run:ai streamer's tensors.

    python benchmarks/weight_read.py MODEL_DIR --rounds 3 --json out.json

Throughput is the checkpoint's bytes over the wall time; medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not benchmarks/: its kernels.py would shadow the kernels package

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from engine.worker.checkpoint_reader import read_checkpoint_file  # noqa: E402


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def _dd(model: Path) -> None:
    for file in _files(model):
        subprocess.run(["dd", f"if={file}", "of=/dev/null", "bs=16M"], check=True,
                       capture_output=True)  # fmt: skip


def _mmap_slices(model: Path) -> Iterator[tuple[str, Any]]:
    for file in _files(model):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name)


def _safetensors(model: Path) -> None:
    for _, tensor in _mmap_slices(model):
        tensor[:]


def _reader(model: Path) -> None:
    for file in _files(model):
        for _ in read_checkpoint_file(file):
            pass


def _engine_load(model: Path, weights: Callable[[Path], Iterator[tuple[str, Any]]]) -> float:
    """Seconds of ``load_weights`` alone (the model is built on the side first)."""
    from engine.config import EngineConfig
    from engine.models import model_class
    from engine.worker.model_loader import load_weights
    from llm_kernels.backend import get_kernel_ops
    from parallel.state import ParallelContext

    config = EngineConfig.from_kwargs(model=str(model), dtype=_ARGS.dtype, device="cpu")
    torch.set_default_dtype(config.model.torch_dtype)
    try:
        built = model_class(config.model)(
            config.model.hf_config, ParallelContext(), ops=get_kernel_ops("torch")
        )
    finally:
        torch.set_default_dtype(torch.float32)
    started = time.perf_counter()
    load_weights(built, weights(model), hf_config=config.model.hf_config)
    return time.perf_counter() - started


def _reader_weights(model: Path) -> Iterator[tuple[str, Any]]:
    for file in _files(model):
        yield from read_checkpoint_file(file)


def _runai_weights(model: Path) -> Iterator[tuple[str, Any]]:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        for file in _files(model):
            streamer.stream_file(str(file))
            yield from streamer.get_tensors()


def _runai(model: Path) -> None:
    checksum = 0
    for _, tensor in _runai_weights(model):
        checksum += int(tensor.view(-1)[-1:].view(torch.uint8).sum())  # touch every tensor


def _fastsafetensors(model: Path) -> None:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    loader.add_filenames({0: [str(f) for f in _files(model)]})
    buffers = loader.copy_files_to_device()
    for name in list(buffers.key_to_rank_lidx):
        buffers.get_tensor(name)
    buffers.close()
    loader.close()


_ARGS: argparse.Namespace
METHODS: dict[str, Callable[[Path], float | None]] = {
    "dd": _dd,
    "safetensors": _safetensors,
    "reader": _reader,
    "engine": lambda m: _engine_load(m, _reader_weights),
    "engine-mmap": lambda m: _engine_load(m, _mmap_slices),
    "runai": _runai,
    "engine-runai": lambda m: _engine_load(m, _runai_weights),
    "fastsafetensors": _fastsafetensors,
}


def _available(name: str) -> bool:
    module = {"runai": "runai_model_streamer", "engine-runai": "runai_model_streamer",
              "fastsafetensors": "fastsafetensors"}.get(name)  # fmt: skip
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def main() -> int:
    global _ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dtype", default="bfloat16", help="the engine loads' model dtype")
    parser.add_argument("--json", type=Path, default=None)
    _ARGS = args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if _available(m)]
    size = sum(f.stat().st_size for f in _files(args.model))
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    dropped = True
    for round_ in range(args.rounds):
        order = methods[round_ % len(methods) :] + methods[: round_ % len(methods)]
        for method in order:
            dropped = drop_page_cache() and dropped
            started = time.perf_counter()
            own = METHODS[method](args.model)
            seconds[method].append(own if own is not None else time.perf_counter() - started)
            print(f"round {round_} {method:16s} {seconds[method][-1]:6.2f} s", flush=True)
    median = {m: statistics.median(s) for m, s in seconds.items()}
    report = {
        "conditions": {
            "checkpoint_bytes": size,
            "page_cache_dropped": dropped,
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "omp_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "seconds": seconds,
        "median_s": median,
        "median_mib_s": {m: size / s / 2**20 for m, s in median.items()},
    }
    print(f"{size / 2**30:.2f} GiB, page cache dropped: {dropped}")
    for method, s in median.items():
        print(f"{method:16s} {s:6.2f} s  {size / s / 2**20:7.0f} MiB/s  (median of {args.rounds})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
