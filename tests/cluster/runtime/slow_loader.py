"""A Ray ``worker_process_setup_hook`` that slows the weight loader in every worker process
of a test's Ray: ``engine.worker.model_loader.iterate_checkpoint`` sleeps before each tensor for the
seconds written in the file named by ``SLOW_LOAD_DELAY_FILE`` (an env var of the job's
runtime_env; read at each load, so a test can change it). Production code has no hook for it.

    ray.init(runtime_env=slow_loader.runtime_env(delay_file))
    slow_loader.set_delay(delay_file, 0.4)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Iterator, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

DELAY_FILE_ENV = "SLOW_LOAD_DELAY_FILE"
HOOK = "tests.cluster.runtime.slow_loader.slow_down"
ROOT = Path(__file__).resolve().parents[3]


def runtime_env(delay_file: Path) -> dict[str, Any]:
    """A job runtime_env whose worker processes load as slowly as ``delay_file`` says (and
    import this checkout)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "worker_process_setup_hook": HOOK,
        "env_vars": {DELAY_FILE_ENV: str(delay_file), "PYTHONPATH": path},
    }


def set_delay(delay_file: Path, seconds_per_tensor: float) -> None:
    delay_file.write_text(str(seconds_per_tensor))


def slow_down() -> None:
    """Slow the loader of this worker process, once it imports it: a worker that never loads a
    model (Serve's controller and proxies) does not import torch for it. Importing it here
    made each of them start seconds later, long enough on a busy 2-core machine for Serve to
    kill a proxy that was still starting (2026-12-07)."""
    module = sys.modules.get(LOADER)
    if module is not None:
        _slow(module)
    else:
        sys.meta_path.insert(0, _SlowOnImport())


LOADER = "engine.worker.model_loader"


class _SlowOnImport(importlib.abc.MetaPathFinder):
    """Finds ``LOADER`` as the path finder does, and slows the module once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != LOADER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_and_slow(module: ModuleType) -> None:
            run(module)
            _slow(module)

        spec.loader.exec_module = run_and_slow  # type: ignore[method-assign]
        return spec


def _slow(loader: ModuleType) -> None:
    delay_file = Path(os.environ[DELAY_FILE_ENV])
    original = loader.iterate_checkpoint

    def slow_iterate(model_path: str | Path, **kwargs: Any) -> Iterator[Any]:
        delay = float(delay_file.read_text())
        for item in original(model_path, **kwargs):
            time.sleep(delay)
            yield item

    loader.iterate_checkpoint = slow_iterate  # type: ignore[attr-defined]
