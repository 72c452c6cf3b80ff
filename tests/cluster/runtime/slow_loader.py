"""Slows the weight loader in every process of a test's Ray that may load a model: its worker
processes, and the engine-core children a head actor starts (plain subprocesses, which Ray's
``worker_process_setup_hook`` never reaches). ``engine.worker.model_loader.iterate_checkpoint``
sleeps before each tensor for the seconds written in the file named by ``SLOW_LOAD_DELAY_FILE``
(read at each load, so a test can change it). Production code has no hook for it.

The job's runtime_env puts ``slow_site/`` first on ``PYTHONPATH``; its ``sitecustomize`` runs at
every such interpreter's start-up (children inherit the variable) and patches the loader module
when something imports it.

    ray.init(runtime_env=slow_loader.runtime_env(delay_file))
    slow_loader.set_delay(delay_file, 0.4)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

DELAY_FILE_ENV = "SLOW_LOAD_DELAY_FILE"
ROOT = Path(__file__).resolve().parents[3]
SITE_DIR = Path(__file__).resolve().parent / "slow_site"


def runtime_env(delay_file: Path) -> dict[str, Any]:
    """A job runtime_env whose processes load as slowly as ``delay_file`` says (and import
    this checkout)."""
    parts = (str(SITE_DIR), str(ROOT), os.environ.get("PYTHONPATH", ""))
    path = os.pathsep.join(p for p in parts if p)
    return {"env_vars": {DELAY_FILE_ENV: str(delay_file), "PYTHONPATH": path}}


def set_delay(delay_file: Path, seconds_per_tensor: float) -> None:
    delay_file.write_text(str(seconds_per_tensor))


def slow_down(loader: ModuleType) -> None:
    """Wraps ``loader.iterate_checkpoint`` (``loader`` is the imported loader module)."""
    delay_file = Path(os.environ[DELAY_FILE_ENV])
    original = loader.iterate_checkpoint

    def slow_iterate(model_path: str | Path, *, progress: bool = True) -> Iterator[Any]:
        delay = float(delay_file.read_text())
        for item in original(model_path, progress=progress):
            time.sleep(delay)
            yield item

    loader.iterate_checkpoint = slow_iterate
