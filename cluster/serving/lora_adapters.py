"""LoRA adapters of a served model, by name: ``<model>:<name>`` in the OpenAI ``model`` field is
the PEFT directory ``<dynamic_lora_loading_path>/<name>`` (Ray Serve LLM's layout). A replica
turns a name into the engine's ``LoRARequest`` (its id stable for the replica's lifetime); the
engine checks the adapter itself (rank, shapes, target modules) when the request is added."""

from __future__ import annotations

import re
from pathlib import Path

from engine.lora import LoRARequest

# A directory name, never a path: no separators, no "..", no leading dot.
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class AdapterNotFoundError(Exception):
    """No adapter of that name in the model's adapter directory (a 404 for the client)."""


class AdapterCatalog:
    def __init__(self, root: str) -> None:
        self.root = Path(root).expanduser()
        self._ids: dict[str, int] = {}

    def request(self, name: str) -> LoRARequest:
        """The ``LoRARequest`` of adapter ``name``; raises ``AdapterNotFoundError``."""
        if not (isinstance(name, str) and _ADAPTER_NAME.fullmatch(name) and ".." not in name):
            raise AdapterNotFoundError(name)
        path = self.root / name
        if not (path / "adapter_config.json").is_file():
            raise AdapterNotFoundError(name)
        lora_int_id = self._ids.setdefault(name, len(self._ids) + 1)
        return LoRARequest(name, lora_int_id, str(path))

    def available(self) -> list[str]:
        """Names of the adapters in the directory (each a PEFT directory)."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if _ADAPTER_NAME.fullmatch(p.name) and (p / "adapter_config.json").is_file()
        )
