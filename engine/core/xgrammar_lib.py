"""xgrammar, imported on its first use rather than with the engine.

Importing xgrammar takes ~0.9 s of CPU (it pulls in transformers), and every process that
imports the engine paid it: the head, each worker, the front replica, every test process,
while most of them never see a grammar. ``xgrammar()`` returns the module, importing it the
first time (the import lock makes concurrent first calls safe), as vLLM's structured-output
code loads it lazily too. The first constrained request of a process pays the import once.
Type hints name ``xgrammar`` under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def xgrammar() -> ModuleType:
    """The ``xgrammar`` module (imported now if it is not yet)."""
    return importlib.import_module("xgrammar")
