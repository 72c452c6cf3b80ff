"""``LoRARequest``: which adapter a request runs under. A module of its own, free of torch, so
that the processes that only route and stream requests (the ingress, the CLI) can name it."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter for a request (vLLM's names and positional order): ``lora_int_id`` (> 0)
    identifies the adapter across requests, ``lora_path`` is a local PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def prefix_key(self) -> str:
        """What the prefix-cache hash chain carries for this adapter's requests."""
        return f"{self.lora_int_id}:{self.lora_name}:{self.lora_path}"


__all__ = ["LoRARequest"]
