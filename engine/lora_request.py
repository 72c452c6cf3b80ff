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
    """A LoRA adapter for a request (vLLM's names and positional order): ``lora_int_id`` (> 0)
    identifies the adapter's weights across requests (the prefix cache keys KV blocks by it, and
    a worker refuses an id whose files changed since it read them: new files at the same path
    need a new id), ``lora_path`` is a local PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

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
