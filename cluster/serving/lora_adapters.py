"""LoRA adapters of a served model, by name: ``<model>:<name>`` in the OpenAI ``model`` field is
the PEFT directory ``<dynamic_lora_loading_path>/<name>`` (Ray Serve LLM's layout). A replica
turns a name into the engine's ``LoRARequest`` on every request (``AdapterCatalog.request``, a
``stat`` of the adapter's two files): its ``lora_int_id`` is a hash of the name and the files'
identity as they are now (the same in every replica and pool that sees the same files), so
files replaced in place get a new id, hence a prefix-cache key and a device slot of their own
(their weights at once, never KV blocks computed with the old ones), and a removed adapter is
``AdapterNotFoundError`` (a 404) at once. ``ReplicaAdapters`` adds Serve's ``serve.multiplexed``
loader, for routing affinity only. The engine checks the adapter itself (rank, shapes, target
modules) when the request is added."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.lora_request import CONFIG_FILE, LoRARequest, adapter_files

# A directory name, never a path: no separators, no "..", no leading dot.
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class AdapterNotFoundError(Exception):
    """No adapter of that name in the model's adapter directory (a 404 for the client)."""


class AdapterCatalog:
    def __init__(self, root: str) -> None:
        self.root = Path(root).expanduser()

    def request(self, name: str) -> LoRARequest:
        """The ``LoRARequest`` of adapter ``name`` as its files are now (another
        ``lora_int_id`` whenever they changed); raises ``AdapterNotFoundError``."""
        if not (isinstance(name, str) and _ADAPTER_NAME.fullmatch(name) and ".." not in name):
            raise AdapterNotFoundError(name)
        path = self.root / name
        files = adapter_files(path)
        if files[0] is None:  # no adapter_config.json: not an adapter (any more)
            raise AdapterNotFoundError(name)
        digest = hashlib.blake2b(repr((name, files)).encode(), digest_size=8).digest()
        lora_int_id = int.from_bytes(digest, "big") >> 2 or 1  # (> 0, and fits an int64)
        return LoRARequest(name, lora_int_id, str(path))

    def has(self, name: str) -> bool:
        try:
            self.request(name)
        except AdapterNotFoundError:
            return False
        return True

    def available(self) -> list[str]:
        """Names of the adapters in the directory (each a PEFT directory)."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if _ADAPTER_NAME.fullmatch(p.name) and (p / CONFIG_FILE).is_file()
        )


def adapter_loader(
    catalog: AdapterCatalog, max_per_replica: int, in_replica: bool
) -> Callable[[str], Awaitable[LoRARequest]]:
    """Inside a Serve replica, a ``serve.multiplexed`` loader: Serve then routes each adapter's
    requests to replicas that already loaded it, and keeps at most ``max_per_replica`` per
    replica (LRU). Outside one, a plain lookup. Its cached ``LoRARequest`` may be stale: a
    request takes ``catalog.request``'s."""

    async def load(name: str) -> LoRARequest:
        return catalog.request(name)

    if not in_replica:
        return load
    from ray import serve

    return serve.multiplexed(max_num_models_per_replica=max_per_replica)(load)


class ReplicaAdapters:
    """A replica's adapters (its ``lora_config``): each request's ``LoRARequest`` from the
    catalog, and Serve's multiplexed loader told of each use (routing affinity)."""

    def __init__(self, lora_config: dict[str, Any], in_replica: bool) -> None:
        self.catalog = AdapterCatalog(lora_config["dynamic_lora_loading_path"])
        if not self.catalog.root.is_dir():
            raise ConfigError(
                f"lora_config.dynamic_lora_loading_path: {str(self.catalog.root)!r} is not "
                "a directory on this node"
            )
        per_replica = lora_config.get("max_num_adapters_per_replica", 16)
        self._load = adapter_loader(self.catalog, per_replica, in_replica)

    async def request(self, name: str) -> LoRARequest:
        """The ``LoRARequest`` of adapter ``name``; raises ``AdapterNotFoundError``."""
        lora_request = self.catalog.request(name)  # its files as they are now
        await self._load(name)  # (its cached LoRARequest may be stale)
        return lora_request
