"""A safetensors checkpoint's tensor names, dtypes and shapes, read from the files' headers
alone (no tensor data, no torch): what the head checks before anything is placed and what the
loader sizes its reads by."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def checkpoint_headers(model_path: str | Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry (``dtype``, ``shape``, ``data_offsets``) of every
    ``*.safetensors`` file: 8-byte length, then that JSON; nothing else is read."""
    headers: dict[str, dict[str, Any]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        headers.update((n, info) for n, info in header.items() if n != "__metadata__")
    return headers


__all__ = ["checkpoint_headers"]
