"""A model's default sampling parameters, as vLLM takes them from the checkpoint: the sampling
values of its ``generation_config.json`` (engine argument ``generation_config: auto``, the
default), of the one in another directory (``generation_config: <dir>``) or none
(``generation_config: vllm``), then ``override_generation_config`` over them. A request field
left unset (or null) takes the model's value, else ``SamplingParams``' own;
``max_new_tokens`` is the default ``max_tokens`` (the server lowers it to what the prompt
leaves).

Read where a model is served (the replica, ``LLM``), not where configs are made: the
directory may exist only there."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.sampling_params import SamplingParams

# vLLM's ``ModelConfig.get_diff_sampling_param`` fields (HF names).
GENERATION_FIELDS = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
    "top_p", "min_p", "max_new_tokens",
)  # fmt: skip


def generation_defaults(
    model_path: str, source: str = "auto", override: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The model's default sampling values, by ``SamplingParams`` name (``max_tokens`` for
    ``max_new_tokens``); a ``ConfigError`` naming the argument when they cannot be used."""
    directory = model_path if source == "auto" else source
    config = {} if source == "vllm" else _generation_config(directory, source)
    config.update(override or {})
    values = _by_sampling_name({name: config.get(name) for name in GENERATION_FIELDS})
    _check(values, source, override or {})
    return values


def with_generation_defaults(
    params: Mapping[str, Any], defaults: Mapping[str, Any], room: int
) -> dict[str, Any]:
    """A request's sampling dict with each of ``defaults`` it leaves unset (absent or None);
    a default ``max_tokens`` is capped at ``room`` (``max_model_len`` less the prompt)."""
    merged = dict(params)
    for name, value in defaults.items():
        if merged.get(name) is None:
            merged[name] = min(value, room) if name == "max_tokens" and room >= 1 else value
    return merged


def check_override(override: Mapping[str, Any]) -> None:
    """``override_generation_config`` as ``SamplingParams`` takes its values, or a
    ``ConfigError`` naming the field (no checkpoint needed: checked with the config)."""
    _check(_by_sampling_name(override), "vllm", override)


def _by_sampling_name(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values that are set, by ``SamplingParams`` name (``max_new_tokens`` as
    ``max_tokens``)."""
    out = {name: value for name, value in values.items() if value is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def _generation_config(directory: str, source: str) -> dict[str, Any]:
    """``generation_config.json`` of ``directory``, or nothing without one (a ``config.json``'s
    sampling fields are not read: transformers 5 drops them, so vLLM has none)."""
    path = Path(directory) / "generation_config.json"
    if path.is_file():
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"generation_config: cannot read {path}: {exc}") from None
    if source != "auto":  # a directory named for it must hold one
        raise ConfigError(
            "generation_config: must be 'auto', 'vllm' or a directory holding "
            f"generation_config.json, got {source!r}"
        )
    return {}


def _check(values: dict[str, Any], source: str, override: Mapping[str, Any]) -> None:
    """The values as ``SamplingParams`` takes them, or a ``ConfigError`` naming where they
    came from and the field."""
    try:
        SamplingParams(**values)
    except (ValueError, TypeError) as exc:
        field = getattr(exc, "param", None)
        field = "max_new_tokens" if field == "max_tokens" else field  # the HF name
        where = "override_generation_config" if field in override else "generation_config"
        origin = "" if source in ("auto", "vllm") else f" ({source})"
        name = f".{field}" if field else ""
        raise ConfigError(f"{where}{name}{origin}: {getattr(exc, 'reason', exc)}") from None


__all__ = [
    "GENERATION_FIELDS",
    "check_override",
    "generation_defaults",
    "with_generation_defaults",
]
