"""A Ray ``worker_process_setup_hook`` that slows the weight loader in every worker process
of a test's Ray: ``engine.worker.model_loader.iterate_checkpoint`` sleeps before each tensor for the
seconds written in the file named by ``SLOW_LOAD_DELAY_FILE`` (an env var of the job's
runtime_env; read at each load, so a test can change it). Production code has no hook for it.

    ray.init(runtime_env=slow_loader.runtime_env(delay_file))
    slow_loader.set_delay(delay_file, 0.4)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
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
    import engine.worker.model_loader as loader

    delay_file = Path(os.environ[DELAY_FILE_ENV])
    original = loader.iterate_checkpoint

    def slow_iterate(model_path: str | Path, **kwargs: Any) -> Iterator[Any]:
        delay = float(delay_file.read_text())
        for item in original(model_path, **kwargs):
            time.sleep(delay)
            yield item

    loader.iterate_checkpoint = slow_iterate  # type: ignore[assignment]
