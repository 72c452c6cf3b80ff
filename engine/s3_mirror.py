"""A node-local copy of an ``s3://`` checkpoint, which the engine then reads as any local
checkpoint directory (the same config, tokenizer and loader; the same tokens).

    s3://bucket/prefix ──▶ <cache_dir>/s3/<endpoint>/<bucket>/<prefix>/
                             config.json, tokenizer files   mirror_checkpoint(weights=False):
                                                            the config check (driver, front)
                             *.safetensors                  weights=True: a worker, before
                                                            it loads
                             .s3-manifest.json              name -> size, ETag, last-modified

The processes of one node copy one at a time (an ``flock`` on ``<dir>.lock``), so the ranks
that start together download once. A file whose listed size and ETag match the manifest and
whose local size matches is kept; any other is downloaded to a temporary file by parallel
ranged GETs (``engine.s3_store``) and renamed into place, so no reader sees part of a file;
files the prefix no longer holds are removed. Weights in formats the loader does not read
(``.bin``, ``.pt``, ...) are not copied.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from engine import envs
from engine.errors import ConfigError
from engine.s3_store import S3Checkpoint, S3File, parse_s3_uri

MANIFEST = ".s3-manifest.json"
_PART_SUFFIX = ".s3-part"
WEIGHT_SUFFIX = ".safetensors"
# Weight files of other formats, never read by the loader: not copied.
_SKIPPED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


def mirror_dir(uri: str, cache_root: Path | None = None, field: str = "model") -> Path:
    """Where this node keeps ``uri``'s copy: ``<cache_dir>/s3/<endpoint>/<bucket>/<prefix>``
    (``<endpoint>`` the store's host and port, ``aws`` for AWS itself)."""
    parsed = parse_s3_uri(uri, field)
    endpoint = envs.s3_endpoint_url()
    store = re.sub(r"[^A-Za-z0-9._-]", "_", urlsplit(endpoint).netloc) if endpoint else "aws"
    root = (cache_root or envs.cache_dir()) / "s3" / store / parsed.bucket
    return root / parsed.prefix if parsed.prefix else root / "_"


def mirror_checkpoint(
    uri: str,
    *,
    weights: bool = True,
    cache_root: Path | None = None,
    field: str = "model",
    require_config: bool = True,
) -> Path:
    """The local directory holding ``uri``'s checkpoint: its config and tokenizer files, and
    with ``weights`` its ``*.safetensors`` too, each fetched only when missing or changed.
    A ``ConfigError`` naming ``field`` when the store cannot be read or the prefix holds no
    ``config.json`` (checked before anything large is fetched; not for a tokenizer alone,
    ``require_config=False``)."""
    store = S3Checkpoint(uri, field)
    files = [f for f in store.list_files() if not f.name.endswith(_SKIPPED_SUFFIXES)]
    names = [f.name for f in files]
    if require_config and "config.json" not in names:
        raise ConfigError(
            f"{field}: {store.uri} holds no config.json (found: {', '.join(names) or 'nothing'})"
        )
    if weights and not any(n.endswith(WEIGHT_SUFFIX) for n in names):
        raise ConfigError(f"{field}: {store.uri} holds no *{WEIGHT_SUFFIX} files")
    target = mirror_dir(uri, cache_root, field)
    target.mkdir(parents=True, exist_ok=True)
    wanted = [f for f in files if weights or not f.name.endswith(WEIGHT_SUFFIX)]
    with _node_lock(target):
        manifest = _read_manifest(target)
        for name in set(manifest) - set(names):  # gone from the store: gone here too
            (target / name).unlink(missing_ok=True)
            del manifest[name]
        for file in wanted:
            if _is_current(target / file.name, manifest.get(file.name), file):
                continue
            part = target / (file.name + _PART_SUFFIX)
            try:
                store.download(file, part)
                os.replace(part, target / file.name)
            finally:
                part.unlink(missing_ok=True)
            manifest[file.name] = _record(file)
            _write_manifest(target, manifest)
        _write_manifest(target, manifest)
    return target


def _record(file: S3File) -> dict[str, Any]:
    return {"size": file.size, "etag": file.etag, "last_modified": file.last_modified}


def _is_current(path: Path, recorded: dict[str, Any] | None, file: S3File) -> bool:
    return recorded == _record(file) and path.is_file() and path.stat().st_size == file.size


def _read_manifest(target: Path) -> dict[str, dict[str, Any]]:
    try:
        manifest = json.loads((target / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _write_manifest(target: Path, manifest: dict[str, dict[str, Any]]) -> None:
    tmp = target / (MANIFEST + _PART_SUFFIX)
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, target / MANIFEST)


@contextlib.contextmanager
def _node_lock(target: Path) -> Iterator[None]:
    """Held by one process of this node at a time (released when the process dies)."""
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


__all__ = ["MANIFEST", "mirror_checkpoint", "mirror_dir"]
