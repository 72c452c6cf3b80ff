"""A safetensors checkpoint's tensor names, dtypes and shapes, read from the files' headers
alone (no tensor data, no torch): what the head checks before anything is placed and what the
loader sizes its reads by. An ``s3://`` checkpoint's headers come from ranged reads of the
store (``engine.s3_store``), so the config check downloads no weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from engine.s3_store import S3Checkpoint, is_s3_uri


def checkpoint_headers(model_path: str | Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry (``dtype``, ``shape``, ``data_offsets``) of every
    ``*.safetensors`` file: 8-byte length, then that JSON; nothing else is read (locally, or
    from the store for an ``s3://`` URI)."""
    if is_s3_uri(model_path):
        return S3Checkpoint(str(model_path)).safetensors_headers()
    headers: dict[str, dict[str, Any]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        headers.update((n, info) for n, info in header.items() if n != "__metadata__")
    return headers


__all__ = ["checkpoint_headers"]
