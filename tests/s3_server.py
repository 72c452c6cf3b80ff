"""An S3-compatible store for the tests: moto's S3 server (``moto.server.ThreadedMotoServer``)
on localhost, reached by real boto3 clients over HTTP through ``AWS_ENDPOINT_URL`` (as MinIO
or any other store would be). It counts the bytes of every object it serves, per key, so a
test can tell what a step transferred."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from moto.server import ThreadedMotoServer

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    # Never look for an instance role when the tests take the keys away.
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
}


class ServedBytes:
    """WSGI middleware: bytes of GET responses per object key, and the GETs per key."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.gets: collections.Counter[str] = collections.Counter()

    def reset(self) -> None:
        with self.lock:
            self.bytes.clear()
            self.gets.clear()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        key = environ.get("PATH_INFO", "").lstrip("/")
        counted = environ.get("REQUEST_METHOD") == "GET" and "list-type" not in environ.get(
            "QUERY_STRING", ""
        )
        if counted:
            with self.lock:
                self.gets[key] += 1
        for chunk in self.app(environ, start_response):
            if counted:
                with self.lock:
                    self.bytes[key] += len(chunk)
            yield chunk


class S3Server:
    """moto's S3 server on a free localhost port, with its served bytes counted."""

    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        # The WSGI server's application, wrapped (werkzeug reads ``server.app`` per request).
        wsgi = self._server._server
        assert wsgi is not None
        self.served = ServedBytes(wsgi.app)
        wsgi.app = self.served
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def upload_dir(self, local: Path, bucket: str, prefix: str) -> str:
        """Every file of ``local`` under ``s3://bucket/prefix/``; returns that URI."""
        s3 = self.client()
        if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=bucket)
        for file in sorted(local.iterdir()):
            if file.is_file():
                s3.upload_file(str(file), bucket, f"{prefix}/{file.name}")
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        self._server.stop()


@contextlib.contextmanager
def serving_checkpoint(local: Path, bucket: str, prefix: str, cache: Path) -> Iterator[S3Server]:
    """A started server holding ``local`` under ``s3://bucket/prefix/``, with this process's
    environment pointing at it (endpoint, credentials) and the node's copies under ``cache``
    (``LLM_CLUSTER_CACHE_DIR``); the environment is restored and the server stopped after."""
    import pytest

    server = S3Server()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in server.env().items():
                mp.setenv(name, value)
            mp.setenv("LLM_CLUSTER_CACHE_DIR", str(cache))
            server.upload_dir(local, bucket, prefix)
            yield server
    finally:
        server.stop()
