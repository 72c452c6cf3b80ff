"""The application's front in the deployment YAML: ``http_options``, ``grpc_options``,
``api_keys`` (where keys come from; only their digests are shipped) and ``responses_store``
(the bounds of the ``/v1/responses`` store); each section's ``check(path)``.
``cluster.config.deployment`` holds the tree they hang in.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.validation import check_int, check_number, check_str, require

# A DNS name: dot-separated labels of letters, digits, '-' (RFC 1123) and '_' (which container
# runtimes' service names have), each at most 63 long.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


@dataclass(frozen=True)
class HTTPOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    request_timeout_s: float | None = None
    # OpenAIIngress replicas (behind Serve's proxy: ``cluster deploy``, ``cluster serve --proxy``).
    ingress_replicas: int = 1

    def check(self, path: str) -> None:
        check_host(self.host, f"{path}.host")
        check_int(self.port, f"{path}.port", ge=0, le=65535)
        check_int(self.max_body_bytes, f"{path}.max_body_bytes", ge=1024)
        if self.request_timeout_s is not None:
            check_number(self.request_timeout_s, f"{path}.request_timeout_s", gt=0)
        check_int(self.ingress_replicas, f"{path}.ingress_replicas", ge=1)


def check_host(host: object, path: str) -> None:
    """An address to listen on: an IP address (``0.0.0.0``: every interface) or a host name,
    without a port. Whether it is an address of the machine that binds it is for that machine
    to say (``cluster.ops.ports``): this check runs wherever the config is read."""
    check_str(host, path, non_empty=True, note="a host name or IP address")
    host = str(host)
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    _, colon, port = host.rpartition(":")
    require(
        not (colon and port.isdigit()),
        path,
        f"must be a host name or IP address without a port, got {host!r}: the port goes in "
        f"{path.removesuffix('.host')}.port",
    )
    require(
        len(host) <= 253 and _HOST_NAME.fullmatch(host) is not None,
        path,
        f"must be a host name or IP address (0.0.0.0: every interface), got {host!r}",
    )


@dataclass(frozen=True)
class ResponsesStoreConfig:
    """Bounds of the application's store of ``/v1/responses`` results
    (``cluster.serving.responses_store``): a least-recently-used entry goes past either
    bound, and each expires ``ttl_s`` after it was stored."""

    max_responses: int = 10_000
    max_bytes: int = 256 << 20
    ttl_s: float = 3600.0

    def check(self, path: str) -> None:
        check_int(self.max_responses, f"{path}.max_responses", ge=1)
        check_int(self.max_bytes, f"{path}.max_bytes", ge=1024)
        check_number(self.ttl_s, f"{path}.ttl_s", gt=0)


@dataclass(frozen=True)
class GRPCOptions:
    port: int = 9000

    def check(self, path: str) -> None:
        check_int(self.port, f"{path}.port", ge=0, le=65535)


@dataclass(frozen=True)
class APIKeysConfig:
    """Where API keys come from — the name of an environment variable or a file path, each
    holding keys separated by commas or newlines. The keys themselves never go in the YAML."""

    env: str | None = None
    file: str | None = None

    def check(self, path: str) -> None:
        require(
            (self.env is None) != (self.file is None),
            path,
            "set exactly one of 'env' (an environment variable name) or 'file' (a path)",
        )

    def load_key_hashes(self, path: str = "api_keys") -> list[str]:
        """Read the keys on the deploying machine; only their sha256 digests are shipped."""
        if self.env is not None:
            raw = os.environ.get(self.env)
            require(raw is not None, f"{path}.env", f"environment variable {self.env!r} is not set")
        else:
            key_file = Path(self.file or "").expanduser()
            require(key_file.is_file(), f"{path}.file", f"{key_file} is not a readable file")
            raw = key_file.read_text()
        keys = [k.strip() for k in (raw or "").replace(",", "\n").splitlines() if k.strip()]
        require(bool(keys), path, "the key source holds no keys")
        return [hashlib.sha256(k.encode()).hexdigest() for k in keys]
