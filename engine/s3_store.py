"""A checkpoint in an S3-compatible object store, read through boto3: ``s3://bucket/prefix``
parsed, the prefix's files listed, byte ranges read, a file downloaded by parallel ranged GETs,
and the safetensors files' headers read alone (8-byte length, then that JSON; no tensor data).

The store and the credentials are boto3's own settings, read by boto3 in each process:
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (MinIO, Ceph, R2, ...; unset: AWS),
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_REGION``, or an instance role. boto3 is the optional extra ``llm-cluster[s3]``. Every
failure (a bad URI, no bucket, no credentials, an unreachable store) is a ``ConfigError``
naming the engine argument (``model``) and the URI. ``engine.s3_mirror`` keeps the node-local
copy the loader reads.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from engine import envs
from engine.errors import ConfigError

S3_SCHEME = "s3://"
PART_BYTES = 16 << 20  # one ranged GET of a download
THREADS = 8  # ranged GETs in flight per file
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def is_s3_uri(source: object) -> bool:
    return isinstance(source, str) and source.startswith(S3_SCHEME)


@dataclass(frozen=True)
class S3Uri:
    """``s3://bucket/prefix``: the checkpoint's files are the objects ``prefix/<name>``."""

    bucket: str
    prefix: str  # without a trailing "/"; "" for the bucket's top level

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name


@dataclass(frozen=True)
class S3File:
    """One object of the checkpoint, as listed: its name under the prefix and its version."""

    name: str
    key: str
    size: int
    etag: str
    last_modified: str


def parse_s3_uri(uri: str, field: str = "model") -> S3Uri:
    """``s3://bucket[/prefix]``; a ``ConfigError`` naming ``field`` otherwise."""
    if not is_s3_uri(uri):
        raise ConfigError(f"{field}: {uri!r} is not an s3://bucket/prefix URI")
    bucket, _, prefix = uri[len(S3_SCHEME) :].partition("/")
    prefix = prefix.strip("/")
    valid_bucket = 3 <= len(bucket) <= 63 and all(c.isalnum() or c in "-._" for c in bucket)
    if not valid_bucket or "//" in prefix or any(p in (".", "..") for p in prefix.split("/")):
        raise ConfigError(
            f"{field}: {uri!r} is not an s3://bucket/prefix URI (a bucket name of 3-63 "
            "letters, digits, '-', '.', '_', then the checkpoint's key prefix)"
        )
    return S3Uri(bucket, prefix)


def _client(field: str, uri: S3Uri) -> Any:
    try:
        import boto3  # the optional extra: imported only where an s3:// model is used
        from botocore.config import Config
    except ImportError as exc:
        raise ConfigError(
            f"{field}: {uri}: an s3:// checkpoint needs boto3, which is not installed "
            f"({exc}); install the extra: pip install 'llm-cluster[s3]'"
        ) from None
    # One pool connection per ranged GET in flight; boto3 reads the endpoint, region and
    # credentials from the environment (AWS_ENDPOINT_URL_S3, AWS_REGION, ...).
    config = Config(max_pool_connections=2 * THREADS, retries={"max_attempts": 5})
    return boto3.session.Session().client("s3", config=config)


@contextmanager
def _named_errors(uri: S3Uri, field: str) -> Iterator[None]:
    """boto3's failures as a ``ConfigError`` naming ``field``, the URI and the endpoint."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    where = f"{field}: {uri}"
    endpoint = envs.s3_endpoint_url()
    store = f"the store at {endpoint}" if endpoint else "AWS S3 (no AWS_ENDPOINT_URL set)"
    try:
        yield
    except NoCredentialsError:
        raise ConfigError(
            f"{where}: no credentials for {store}; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance role) in every node's "
            "environment"
        ) from None
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        if code == "NoSuchBucket":
            raise ConfigError(f"{where}: {store} has no bucket {uri.bucket!r}") from None
        if code in ("NoSuchKey", "404", "PreconditionFailed", "412"):
            raise ConfigError(
                f"{where}: an object changed or disappeared while it was read; start again"
            ) from None
        raise ConfigError(f"{where}: {store} refused: {code} {error.get('Message', '')}") from None
    except BotoCoreError as exc:
        raise ConfigError(f"{where}: {store}: {exc}") from None


class S3Checkpoint:
    """The files of one checkpoint prefix and the reads of them, on one boto3 client."""

    def __init__(self, uri: str, field: str = "model") -> None:
        self.uri = parse_s3_uri(uri, field)
        self.field = field
        self._s3 = _client(field, self.uri)

    def errors(self) -> Any:
        return _named_errors(self.uri, self.field)

    def list_files(self) -> list[S3File]:
        """The objects directly under the prefix (as a local checkpoint is one directory);
        a ``ConfigError`` when there are none."""
        files = []
        with self.errors():
            pages = self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.uri.bucket, Prefix=self.uri.key(""), Delimiter="/"
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(self.uri.key("")) :]
                    if name and not name.endswith("/"):
                        files.append(
                            S3File(
                                name,
                                obj["Key"],
                                int(obj["Size"]),
                                str(obj.get("ETag", "")).strip('"'),
                                obj["LastModified"].isoformat(),
                            )
                        )
        if not files:
            raise ConfigError(f"{self.field}: {self.uri}: no objects under this prefix")
        return sorted(files, key=lambda f: f.name)

    def read_range(self, file: S3File, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``file``, checked to be the version listed (its ETag)."""
        if end <= start:
            return b""
        with self.errors():
            reply = self._s3.get_object(
                Bucket=self.uri.bucket,
                Key=file.key,
                Range=f"bytes={start}-{end - 1}",
                IfMatch=file.etag,
            )
            data = reply["Body"].read()
        if len(data) != end - start:
            raise ConfigError(
                f"{self.field}: {self.uri}: {file.name}: asked for {end - start} bytes at "
                f"{start}, got {len(data)}"
            )
        return data

    def download(self, file: S3File, dest: str | os.PathLike[str]) -> None:
        """Write ``file`` to ``dest`` by ``PART_BYTES`` ranged GETs, ``THREADS`` at a time,
        each written at its offset."""
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, file.size)

            def part(start: int) -> None:
                data = memoryview(self.read_range(file, start, min(start + PART_BYTES, file.size)))
                while data:
                    written = os.pwrite(fd, data, start)
                    data, start = data[written:], start + written

            starts = range(0, file.size, PART_BYTES)
            with ThreadPoolExecutor(THREADS, thread_name_prefix="s3-part") as pool:
                for done in [pool.submit(part, s) for s in starts]:
                    done.result()
            os.fsync(fd)
        finally:
            os.close(fd)

    def safetensors_headers(self) -> dict[str, dict[str, Any]]:
        """``engine.checkpoint_headers``' answer for this prefix, from ranged GETs of each
        ``*.safetensors`` file's 8-byte length and header only."""
        files = [f for f in self.list_files() if f.name.endswith(".safetensors")]

        def header(file: S3File) -> dict[str, Any]:
            (length,) = struct.unpack("<Q", self.read_range(file, 0, 8))
            if not 0 < length <= min(_MAX_HEADER_BYTES, file.size - 8):
                raise ConfigError(
                    f"{self.field}: {self.uri}: {file.name} is not a safetensors file "
                    f"(header length {length})"
                )
            return json.loads(self.read_range(file, 8, 8 + length))

        headers: dict[str, dict[str, Any]] = {}
        with ThreadPoolExecutor(THREADS, thread_name_prefix="s3-header") as pool:
            for found in pool.map(header, files):
                headers.update((n, info) for n, info in found.items() if n != "__metadata__")
        return headers


__all__ = [
    "PART_BYTES",
    "S3_SCHEME",
    "THREADS",
    "S3Checkpoint",
    "S3File",
    "S3Uri",
    "is_s3_uri",
    "parse_s3_uri",
]
