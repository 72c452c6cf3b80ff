"""``kv_transfer_config``, as vLLM spells it, parsed and checked before anything is placed.

kv_transfer_config:
  kv_connector: SharedStorageConnector
  kv_role: kv_both            # kv_producer: saves only; kv_consumer: loads only
  kv_connector_extra_config:
    shared_storage_path: /dev/shm/llm-cluster-kv   # default: /dev/shm (else the temp dir)
    max_storage_bytes: 4294967296                  # the store's size bound (LRU beyond it)

kv_transfer_config:
  kv_connector: NixlConnector  # decode reads the prefill engine's blocks (NIXL READ)
  kv_role: kv_both            # kv_producer: prefills for remote decode; kv_consumer: reads
  kv_connector_extra_config:
    abort_request_timeout_s: 480   # a prefill holds unread blocks this long at most
    transfer_timeout_s: 30         # a read not done by then is recomputed
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from engine.core.kv_cache_groups import kv_cache_group_specs
from engine.validation import check_choice, check_int, check_number, require

CONNECTORS = ("SharedStorageConnector", "NixlConnector")
ROLES = ("kv_both", "kv_producer", "kv_consumer")
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
# Each connector's kv_connector_extra_config keys.
_EXTRA_KEYS = {
    "SharedStorageConnector": ("shared_storage_path", "max_storage_bytes"),
    "NixlConnector": ("abort_request_timeout_s", "transfer_timeout_s"),
}
DEFAULT_MAX_STORAGE_BYTES = 4 << 30
# vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default.
DEFAULT_ABORT_REQUEST_TIMEOUT_S = 480.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0


def default_storage_path() -> str:
    """Shared memory when the machine has it (a store of KV blocks is read back at memory
    speed and shared by every process of the node), else the temporary directory."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, "llm-cluster-kv")


@dataclass(frozen=True)
class KVConnectorExtraConfig:
    """``kv_transfer_config.kv_connector_extra_config``: ``SharedStorageConnector``'s store,
    or ``NixlConnector``'s timeouts (each connector accepts only its own keys)."""

    shared_storage_path: str = field(default_factory=default_storage_path)
    max_storage_bytes: int = DEFAULT_MAX_STORAGE_BYTES
    abort_request_timeout_s: float = DEFAULT_ABORT_REQUEST_TIMEOUT_S
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S

    def __post_init__(self) -> None:
        key = "kv_transfer_config.kv_connector_extra_config."
        require(
            isinstance(self.shared_storage_path, str) and bool(self.shared_storage_path),
            key + "shared_storage_path",
            f"must be a directory path, got {self.shared_storage_path!r}",
        )
        check_int(self.max_storage_bytes, key + "max_storage_bytes", ge=1 << 20, note="bytes")
        for name in ("abort_request_timeout_s", "transfer_timeout_s"):
            check_number(getattr(self, name), key + name, gt=0, note="seconds")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: KVConnectorExtraConfig = field(
        default_factory=KVConnectorExtraConfig
    )

    def __post_init__(self) -> None:
        key = "kv_transfer_config."
        check_choice(self.kv_connector, key + "kv_connector", CONNECTORS)
        check_choice(self.kv_role, key + "kv_role", ROLES)

    @property
    def shared_storage_path(self) -> str:
        return self.kv_connector_extra_config.shared_storage_path

    @property
    def max_storage_bytes(self) -> int:
        return self.kv_connector_extra_config.max_storage_bytes

    @property
    def abort_request_timeout_s(self) -> float:
        return self.kv_connector_extra_config.abort_request_timeout_s

    @property
    def transfer_timeout_s(self) -> float:
        return self.kv_connector_extra_config.transfer_timeout_s

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    @classmethod
    def from_arg(cls, value: Any) -> KVTransferConfig | None:
        """The engine argument (vLLM's dict, or None: no connector) as a config."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        require(
            isinstance(value, dict),
            "kv_transfer_config",
            f"must be a mapping (e.g. {{'kv_connector': 'SharedStorageConnector', 'kv_role': "
            f"'kv_both'}}) or null, got {value!r}",
        )
        for name in value:
            require(
                name in _KEYS,
                f"kv_transfer_config.{name}",
                f"must be one of the keys {', '.join(_KEYS)}, got an unknown key",
            )
        require(
            "kv_connector" in value,
            "kv_transfer_config.kv_connector",
            f"is required: one of {', '.join(repr(c) for c in CONNECTORS)}",
        )
        extra = value.get("kv_connector_extra_config") or {}
        require(
            isinstance(extra, dict),
            "kv_transfer_config.kv_connector_extra_config",
            f"must be a mapping, got {extra!r}",
        )
        check_choice(value["kv_connector"], "kv_transfer_config.kv_connector", CONNECTORS)
        keys = _EXTRA_KEYS[value["kv_connector"]]
        for name in extra:
            require(
                name in keys,
                f"kv_transfer_config.kv_connector_extra_config.{name}",
                f"must be one of {value['kv_connector']}'s keys {', '.join(keys)}, got an "
                "unknown key",
            )
        fields = {k: v for k, v in value.items() if k != "kv_connector_extra_config"}
        return cls(**fields, kv_connector_extra_config=KVConnectorExtraConfig(**extra))


@dataclass(frozen=True)
class KVTransferArgs:
    """``EngineConfig.kv_transfer``: the ``kv_transfer_config`` engine argument, kept parsed
    (None: no connector, the engine unchanged), the store's directory for this engine
    (``engine.kv_transfer.store.store_namespace``: also the layout another engine's blocks
    must have to be read), and ``engine_id``: a name with a nonce drawn at this start, so a
    restarted engine's blocks are never read through a handle of its previous life. Both are
    set once by ``EngineConfig.from_kwargs`` on the head: every worker uses the head's."""

    kv_transfer_config: KVTransferConfig | None = None
    namespace: str = ""
    engine_id: str = ""

    def __post_init__(self) -> None:
        parsed = KVTransferConfig.from_arg(self.kv_transfer_config)
        object.__setattr__(self, "kv_transfer_config", parsed)


def check_kv_transfer_support(
    kv: KVTransferConfig | None,
    hf: dict[str, Any],
    max_model_len: int,
    enable_prefix_caching: bool,
    data_parallel_size: int = 1,
) -> None:
    """Engine settings the connector cannot serve exactly, refused before anything is placed:
    it keys blocks by their prefix-cache hash, and it moves one block table's blocks (a model
    whose sliding-window layers keep blocks of their own has several)."""
    if kv is None:
        return
    require(
        kv.kv_connector != "NixlConnector"
        or any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12")),
        "kv_transfer_config.kv_connector",
        "NixlConnector needs NIXL, which is not installed (pip install 'nixl-cu12>=1.5.1,<2')",
    )
    require(
        kv.kv_connector != "NixlConnector" or data_parallel_size == 1,
        "kv_transfer_config.kv_connector",
        "NixlConnector names one engine's agents per handle: run data-parallel ranks as "
        f"replicas instead, got data_parallel_size {data_parallel_size}",
    )
    require(
        enable_prefix_caching,
        "kv_transfer_config",
        "needs enable_prefix_caching (blocks are stored and found by their prefix-cache "
        "hash), got enable_prefix_caching false",
    )
    groups = kv_cache_group_specs(hf, max_model_len)
    require(
        len(groups) == 1,
        "kv_transfer_config",
        f"{kv.kv_connector} moves one KV cache group's blocks; this model's sliding-window "
        f"layers make {len(groups)} groups (full attention and windows of "
        f"{', '.join(str(g.sliding_window) for g in groups if g.sliding_window)} tokens)",
    )
