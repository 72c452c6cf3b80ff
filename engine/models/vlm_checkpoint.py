"""Checkpoint names of the vision-language models. A VLM's checkpoint holds its language model
under one of several prefixes (the hub's, transformers 4.52's, transformers 5's save) beside
its tower and projector; ``VLMCheckpointNames`` gives a model the loader's hooks for them:

    name ─ checkpoint_renames (prefix -> ours, first match wins)
         ├─ under vision_prefixes (tower, projector): as it is
         └─ the language model's: q/k/v, gate/up fused as packed_modules_mapping says

It goes before the language model's ``CausalLM`` in the bases (``checkpoint_aliases`` passes the
renamed name on to it)."""

from __future__ import annotations

from typing import Any, ClassVar


def rename_prefix(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first of ``renames``' prefixes it starts with replaced."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


class VLMCheckpointNames:
    """``checkpoint_target`` / ``checkpoint_aliases`` of a VLM (see the module docstring)."""

    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]]
    vision_prefixes: ClassVar[tuple[str, ...]]
    packed_modules_mapping: dict[str, tuple[str, Any]]

    def checkpoint_name(self, name: str) -> str:
        return rename_prefix(name, self.checkpoint_renames)

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        name = self.checkpoint_name(name)
        if name.startswith(self.vision_prefixes):
            return name, None
        for hf_name, (fused, part) in self.packed_modules_mapping.items():
            if f".{hf_name}." in name:
                return name.replace(f".{hf_name}.", f".{fused}."), part
        return name, None

    def checkpoint_aliases(self, name: str) -> Any:
        return super().checkpoint_aliases(self.checkpoint_name(name))  # type: ignore[misc]
