"""Run by ``site`` at the start-up of every interpreter with this folder on its path (see
tests/cluster/runtime/slow_loader.py): once ``engine.worker.model_loader`` is imported, its
checkpoint iterator is slowed. Nothing is imported before that, so processes that never load
a model (Serve's controller and proxy) start as fast as ever."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType


class _SlowOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "engine.worker.model_loader":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_slow(module: ModuleType) -> None:
            exec_module(module)
            from tests.cluster.runtime.slow_loader import slow_down

            slow_down(module)

        spec.loader.exec_module = exec_and_slow  # type: ignore[method-assign]
        return spec


if os.environ.get("SLOW_LOAD_DELAY_FILE"):
    sys.meta_path.insert(0, _SlowOnImport())
