"""Compiling this package's C++ kernels (``csrc/``) with torch's extension builder, once per
source and flags, into a cache that several processes and machines may share.

g++ and ninja build a source on first use (~10 s) under ``TORCH_EXTENSIONS_DIR``
(``~/.cache/torch_extensions`` by default), in a folder named by a hash of the source (its text
and path), the flags and the torch version. Flags name instruction sets explicitly
(``-mavx512f ...``), never ``-march=native``, so a shared cache holds binaries each machine
can run. Each build is guarded by an ``flock`` that dies with its holder: torch's own lock file
outlives a process killed mid-build (a worker whose app was deleted) and would make every later
build wait forever, so it is cleared under the flock.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["build_extension"]

CSRC = Path(__file__).parent / "csrc"
_lock = threading.Lock()


def build_extension(name: str, source: str, flags: list[str]) -> ModuleType:
    """Compile (or find compiled) and import ``csrc/<source>`` as module ``<name>``; raises
    whatever the build raises (no compiler, a compile error)."""
    from torch.utils import cpp_extension

    path = CSRC / source
    # The source's path too: torch's build files name it, so two checkouts sharing one cache
    # (worktrees) would otherwise rebuild each other's binaries in turn.
    parts = [path.read_bytes(), str(path).encode(), " ".join(flags).encode()]
    key = hashlib.sha256(b"\0".join([*parts, torch.__version__.encode()])).hexdigest()[:16]
    root = Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )
    build_dir = root / f"{name}_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # The ninja that `pip install ninja` puts beside this interpreter, even where the process's
    # PATH does not name the venv (a Ray worker started without it).
    search = os.environ.get("PATH", "")
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in search.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + search
    with _lock, open(build_dir.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(path)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
