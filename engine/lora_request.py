"""``LoRARequest``: which adapter a request runs under; a PEFT adapter directory's files and
their identity now (``adapter_files``). A module of its own, free of torch, so that the processes
that only route and stream requests (the ingress, the CLI) can name it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# (st_ino, st_size, st_mtime_ns, st_ctime_ns) of the config and of the weights; None: no file.
AdapterFiles = tuple[tuple[int, int, int, int] | None, ...]


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter for a request (vLLM's fields, positional order and equality):
    ``lora_int_id`` (> 0) identifies the adapter's weights across requests (the prefix cache keys
    KV blocks by it, and a worker refuses an id whose files changed since it read them: new files
    at the same path need a new id), ``lora_path`` is a local PEFT directory (``~`` expanded and
    made absolute here, in the caller's directory, so every process reads the same one; empty is
    refused when a request names it). ``base_model_name`` is recorded, not checked: the adapter's
    shapes are checked against this engine's model. ``load_inplace`` re-reads and re-checks the
    adapter's files even if its id is loaded; files changed since that id was loaded are refused
    (new weights need a new id here, never KV blocks cached under the old ones). Equal and hashed
    by ``lora_name``, as vLLM's; the engine tells adapters apart by ``identity``."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        path = self.lora_path
        if isinstance(path, (str, os.PathLike)) and os.fspath(path):
            path = os.path.abspath(os.path.expanduser(os.fspath(path)))
            msgspec.structs.force_setattr(self, "lora_path", path)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def identity(self) -> tuple[str, int, str]:
        """What one adapter is to the engine: its name, id and path."""
        return (self.lora_name, self.lora_int_id, self.lora_path)

    @property
    def prefix_key(self) -> str:
        """What the prefix-cache hash chain carries for this adapter's requests."""
        return f"{self.lora_int_id}:{self.lora_name}:{self.lora_path}"


def adapter_files(path: str | os.PathLike[str]) -> AdapterFiles:
    """What tells one version of an adapter's files from another, by ``stat`` alone: a file
    written in place changes its ctime (which no one can set back), a replaced one its inode."""
    identity = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = os.stat(Path(path) / name)
        except OSError:
            identity.append(None)
            continue
        regular = stat.S_ISREG(st.st_mode)
        identity.append(
            (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) if regular else None
        )
    return tuple(identity)


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "AdapterFiles", "LoRARequest", "adapter_files"]
