"""Every environment variable the project reads, in one place.

Each is read when accessed (not at import), so tests can set them with monkeypatch.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where built-in models are materialized: ``LLM_CLUSTER_CACHE_DIR``, default
    ~/.cache/llm-cluster."""
    value = os.environ.get("LLM_CLUSTER_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "llm-cluster"


def log_level() -> str:
    """``LLM_CLUSTER_LOG_LEVEL``: level of the ``llm_cluster`` loggers (default INFO)."""
    return os.environ.get("LLM_CLUSTER_LOG_LEVEL", "INFO").upper()


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1`` runs Triton kernels on CPU tensors through the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_ray_token_auth_if_available() -> None:
    """Ray 2.5x+ ``ray start`` enables token authentication and writes the token to
    ``~/.ray/auth_token``, but a driver joining by address does not turn token mode on by
    itself. Do what a local ``ray.init()`` does: token mode when ``RAY_AUTH_MODE`` is unset
    and a token is at hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or the default file)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or Path(token_path).is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
