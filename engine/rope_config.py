"""The rotary-embedding parameters of an HF config, normalized, checked, and the context length
they support. Torch-free: the deploy-time config check imports it.

Two formats reach us. Checkpoints on the Hub carry the classic ``config.json`` keys::

    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...},   # or legacy "type"; or null
    "partial_rotary_factor": 0.75,                  # Phi-4-mini: only 3/4 of each head rotates
    "original_max_position_embeddings": 4096,       # Phi-3: wins over rope_scaling's own
    "rope_local_base_freq": 10000.0,                # Gemma 3: theta of the sliding_attention
                                                    # layers, which are unscaled: rope_scaling
                                                    # and rope_theta are the global layers'

transformers 5 writes ``rope_parameters`` instead, either one dict for every layer or one per
layer type::

    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, ...}
    "rope_parameters": {"full_attention": {...}, "sliding_attention": {...}}

``rope_parameters(hf, layer_type)`` turns either into one flat dict in which every default HF
would fill in is resolved (yarn's and longrope's attention factor included), so a rotary table
can be built from it alone. ``check_rope`` runs that for every layer type and raises
``ConfigError`` naming the field; ``rope_max_positions`` is the longest context the rope serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from engine.errors import ConfigError
from engine.hf_defaults import HF_CODE_DEFAULTS
from engine.model_heads import family_architecture

__all__ = ["ROPE_TYPES", "check_rope", "rope_max_positions", "rope_parameters"]

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Older names of a type: Phi-3's first checkpoints called longrope "su".
_TYPE_ALIASES = {"su": "longrope"}
# Gemma 3's defaults when its config omits a theta (transformers' Gemma3TextConfig).
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_DEFAULT_THETA = 10_000.0
# vLLM's default when a config names no max_position_embeddings (engine.config does the same).
_DEFAULT_MAX_POSITIONS = 2048


def rope_parameters(hf: Mapping[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The normalized rope of the layers of ``layer_type`` (None: the model's only, or its
    ``full_attention``, rope). Always has ``rope_type``, ``rope_theta`` and
    ``partial_rotary_factor``, plus per type:

    - linear: ``factor``
    - dynamic: ``factor``, ``original_max_position_embeddings`` (the config's
      max_position_embeddings, which dynamic NTK takes as the trained length)
    - llama3: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
      ``original_max_position_embeddings``
    - yarn: ``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
      ``attention_factor``, ``truncate``
    - longrope: ``short_factor``, ``long_factor``, ``original_max_position_embeddings``,
      ``factor``, ``attention_factor``

    Raises ``ConfigError`` naming the field for an unknown type or a missing or invalid value.
    """
    raw, where = _raw_rope(hf, layer_type)
    rope_type = _rope_type(hf, raw, where)
    params: dict[str, Any] = {
        "rope_type": rope_type,
        "rope_theta": _theta(hf, raw, where, layer_type),
        "partial_rotary_factor": _partial_rotary_factor(hf, raw, where),
    }
    if rope_type in ("linear", "dynamic"):
        params["factor"] = _positive(raw.get("factor"), f"{where}.factor", rope_type)
    if rope_type == "dynamic":
        params["original_max_position_embeddings"] = _max_positions(hf, required=True)
    if rope_type == "llama3":
        params.update(_llama3_fields(hf, raw, where))
    if rope_type == "yarn":
        params.update(_yarn_fields(hf, raw, where))
    if rope_type == "longrope":
        params.update(_longrope_fields(hf, raw, where, params["partial_rotary_factor"]))
    return params


def check_rope(hf: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` naming the field if any layer type's rope is unsupported or
    malformed, or if it would rotate an odd number of dimensions per head."""
    nested = _nested_rope_parameters(hf)
    if nested is not None:
        missing = sorted(set(hf.get("layer_types") or ()) - set(nested))
        if missing:
            raise ConfigError(
                f"rope_parameters: has no entry for layer type {missing[0]!r} "
                f"(it has {sorted(nested)})"
            )
    head_dim = rope_head_dim(hf)
    # The declared layer types too: a type whose rope entry is null is refused here, not
    # when its layer is built.
    declared = hf.get("layer_types") or ()
    for layer_type in dict.fromkeys([*_rope_layer_types(hf), *declared]):
        params = rope_parameters(hf, layer_type)
        if head_dim is not None:
            rotary_dim = int(head_dim * params["partial_rotary_factor"])
            if rotary_dim < 2 or rotary_dim % 2:
                raise ConfigError(
                    f"partial_rotary_factor: {params['partial_rotary_factor']!r} rotates "
                    f"{rotary_dim} of the {head_dim} head dimensions; that must be even and >= 2"
                )


def rope_max_positions(hf: Mapping[str, Any]) -> int:
    """The longest context the rope serves: the bound on max_model_len and the rows of a
    rotary table.

    vLLM's convention (``_get_and_verify_max_len``): linear and dynamic configs give the
    trained length as max_position_embeddings, so it is multiplied by ``factor``; yarn's is
    ``original_max_position_embeddings * factor`` (Qwen2.5: 32768 * 4 = 131072); llama3 and
    longrope configs already give the extended length, as does Gemma 3 (131072 with linear
    factor 8), which is never multiplied. With several layer types the most extended wins:
    an unscaled type (Gemma's sliding layers) rotates any position the same way.
    """
    max_positions = _max_positions(hf)
    if "gemma3" in str(hf.get("model_type") or ""):
        return max_positions
    longest = 0.0
    for layer_type in _rope_layer_types(hf):
        params = rope_parameters(hf, layer_type)
        if params["rope_type"] in ("linear", "dynamic"):
            longest = max(longest, max_positions * params["factor"])
        elif params["rope_type"] == "yarn":
            longest = max(longest, params["original_max_position_embeddings"] * params["factor"])
        else:
            longest = max(longest, max_positions)
    return int(longest)


def _raw_rope(hf: Mapping[str, Any], layer_type: str | None) -> tuple[dict[str, Any], str]:
    """The rope dict as written for ``layer_type``, and its name in the config (for errors)."""
    scaling = hf.get("rope_scaling")
    nested = _nested_rope_parameters(hf)
    if not scaling and nested is not None:
        key = layer_type or "full_attention"
        if key not in nested:
            raise ConfigError(
                f"rope_parameters: has no entry for layer type {key!r} (it has {sorted(nested)})"
            )
        if nested[key] is None:
            raise ConfigError(f"rope_parameters.{key}: layers without rope are not supported")
        return dict(nested[key]), f"rope_parameters.{key}"
    if layer_type == "sliding_attention" and _has_local_base(hf):
        # Gemma 3's rope_scaling and rope_theta are the global layers'; local ones rotate
        # unscaled with their own base.
        theta = hf.get("rope_local_base_freq", _GEMMA3_THETA["sliding_attention"])
        return {"rope_theta": _positive(theta, "rope_local_base_freq")}, "rope_scaling"
    if scaling:
        if not isinstance(scaling, Mapping):
            raise ConfigError(f"rope_scaling: must be a mapping or null, got {scaling!r}")
        return dict(scaling), "rope_scaling"
    v5 = hf.get("rope_parameters")
    if v5:
        if not isinstance(v5, Mapping):
            raise ConfigError(f"rope_parameters: must be a mapping or null, got {v5!r}")
        return dict(v5), "rope_parameters"
    return {}, "rope_scaling"


def _nested_rope_parameters(hf: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """transformers-5 ``rope_parameters`` keyed by layer type, else None. A flat dict always
    has a non-dict value (a theta, a type name), a keyed one only dicts (or None: no rope)."""
    v5 = hf.get("rope_parameters")
    if not isinstance(v5, Mapping) or not v5:
        return None
    return v5 if all(v is None or isinstance(v, Mapping) for v in v5.values()) else None


def _has_local_base(hf: Mapping[str, Any]) -> bool:
    return "rope_local_base_freq" in hf or "gemma3" in str(hf.get("model_type") or "")


def _rope_layer_types(hf: Mapping[str, Any]) -> list[str | None]:
    nested = _nested_rope_parameters(hf)
    if nested is not None and not hf.get("rope_scaling"):
        return [key for key, value in nested.items() if value is not None]
    if _has_local_base(hf):
        return ["full_attention", "sliding_attention"]
    return [None]


def _rope_type(hf: Mapping[str, Any], raw: Mapping[str, Any], where: str) -> str:
    # HF reads "rope_type" first and falls back to the legacy "type".
    key = "rope_type" if raw.get("rope_type") is not None else "type"
    name = raw.get(key) or "default"
    rope_type = _TYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if rope_type == "yarn" and hf.get("model_type") == "phi3":
        # Phi3Config reads a "yarn" rope as longrope (same short/long factor fields).
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}.{key}: {name!r} is not supported ({', '.join(ROPE_TYPES)})")
    return rope_type


def _theta(
    hf: Mapping[str, Any], raw: Mapping[str, Any], where: str, layer_type: str | None
) -> float:
    # The rope dict's own theta wins over the top-level one, as in transformers.
    if raw.get("rope_theta") is not None:
        return _positive(raw["rope_theta"], f"{where}.rope_theta")
    if hf.get("rope_theta") is not None:
        return _positive(hf["rope_theta"], "rope_theta")
    if "gemma3" in str(hf.get("model_type") or ""):
        return _GEMMA3_THETA.get(layer_type or "full_attention", _DEFAULT_THETA)
    return _DEFAULT_THETA


def _partial_rotary_factor(hf: Mapping[str, Any], raw: Mapping[str, Any], where: str) -> float:
    if raw.get("partial_rotary_factor") is not None:
        value, field = raw["partial_rotary_factor"], f"{where}.partial_rotary_factor"
    elif hf.get("partial_rotary_factor") is not None:
        value, field = hf["partial_rotary_factor"], "partial_rotary_factor"
    else:
        # (GLM-4.5 rotates half of each head unless told otherwise.)
        return HF_CODE_DEFAULTS.get(family_architecture(hf), {}).get("partial_rotary_factor", 1.0)
    factor = _positive(value, field)
    if factor > 1.0:
        raise ConfigError(f"{field}: must be in (0, 1], got {value!r}")
    return factor


def _original_max_positions(hf: Mapping[str, Any], raw: Mapping[str, Any], where: str) -> int:
    """The trained context length of llama3/yarn/longrope. A top-level value wins (Phi-3 keeps
    it there; transformers gives it priority), then the rope dict's, then max_position_embeddings.
    """
    if hf.get("original_max_position_embeddings") is not None:
        value, field = hf["original_max_position_embeddings"], "original_max_position_embeddings"
    elif raw.get("original_max_position_embeddings") is not None:
        value = raw["original_max_position_embeddings"]
        field = f"{where}.original_max_position_embeddings"
    else:
        return _max_positions(hf, required=True)
    return _positive_int(value, field)


def _llama3_fields(hf: Mapping[str, Any], raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    low = _positive(raw.get("low_freq_factor"), f"{where}.low_freq_factor", "llama3")
    high = _positive(raw.get("high_freq_factor"), f"{where}.high_freq_factor", "llama3")
    if high <= low:
        raise ConfigError(
            f"{where}.high_freq_factor: must be > low_freq_factor ({low!r}), got {high!r}"
        )
    return {
        "factor": _positive(raw.get("factor"), f"{where}.factor", "llama3"),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": _original_max_positions(hf, raw, where),
    }


def _yarn_fields(hf: Mapping[str, Any], raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    original = _original_max_positions(hf, raw, where)
    if raw.get("factor") is None:
        # DeepSeek-V3 style: the factor is the ratio of the extended to the trained length.
        factor = _max_positions(hf, required=True) / original
    else:
        factor = _positive(raw["factor"], f"{where}.factor")
    # transformers uses `or`: an explicit 0 or null falls back to the paper's 32 / 1.
    beta_fast = _positive(raw.get("beta_fast") or 32, f"{where}.beta_fast")
    beta_slow = _positive(raw.get("beta_slow") or 1, f"{where}.beta_slow")
    truncate = raw.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}.truncate: must be true or false, got {truncate!r}")
    if raw.get("attention_factor") is not None:
        attention_factor = _positive(raw["attention_factor"], f"{where}.attention_factor")
    else:
        mscale, mscale_all_dim = raw.get("mscale"), raw.get("mscale_all_dim")
        attention_factor = _yarn_attention_factor(factor, mscale, mscale_all_dim)
    return {
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": beta_fast,
        "beta_slow": beta_slow,
        "attention_factor": attention_factor,
        "truncate": truncate,
    }


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(factor: float, mscale: Any, mscale_all_dim: Any) -> float:
    # YaRN's sqrt(1/t) = 0.1 ln(s) + 1; DeepSeek's mscale / mscale_all_dim reweight it (both
    # must be set and non-zero, as in transformers).
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _longrope_fields(
    hf: Mapping[str, Any], raw: Mapping[str, Any], where: str, partial_rotary_factor: float
) -> dict[str, Any]:
    original = _original_max_positions(hf, raw, where)
    head_dim = _head_dim(hf)
    expected = None if head_dim is None else int(head_dim * partial_rotary_factor) // 2
    short = _factor_list(raw.get("short_factor"), f"{where}.short_factor", expected)
    long = _factor_list(raw.get("long_factor"), f"{where}.long_factor", expected)
    if raw.get("factor") is None:
        # Phi-3 gives no factor: the extension is max_position_embeddings / the trained length.
        factor = _max_positions(hf, required=True) / original
    else:
        factor = _positive(raw["factor"], f"{where}.factor")
    if raw.get("attention_factor") is not None:
        attention_factor = _positive(raw["attention_factor"], f"{where}.attention_factor")
    elif factor <= 1.0:
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": original,
        "factor": factor,
        "attention_factor": attention_factor,
    }


def _factor_list(value: Any, field: str, expected: int | None) -> list[float]:
    if value is None:
        raise ConfigError(f"{field}: required for rope_type 'longrope'")
    if not isinstance(value, (list, tuple)) or not all(_is_number(v) and v > 0 for v in value):
        raise ConfigError(f"{field}: must be a list of numbers > 0, got {value!r}")
    if expected is not None and len(value) != expected:
        raise ConfigError(
            f"{field}: must have {expected} entries (half the rotary dimensions), got {len(value)}"
        )
    return [float(v) for v in value]


def rope_head_dim(hf: Mapping[str, Any]) -> int | None:
    """The head dim the rope rotates within: a head's ``qk_rope_head_dim`` part under
    multi-head latent attention (a DeepSeek config, one with ``kv_lora_rank``; transformers'
    default 64), else the attention head dim."""
    if hf.get("kv_lora_rank"):
        return int(hf.get("qk_rope_head_dim") or 64)
    return _head_dim(hf)


def _head_dim(hf: Mapping[str, Any]) -> int | None:
    if hf.get("head_dim"):
        return int(hf["head_dim"])
    if hf.get("hidden_size") and hf.get("num_attention_heads"):
        return int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return None


def _max_positions(hf: Mapping[str, Any], required: bool = False) -> int:
    value = hf.get("max_position_embeddings")
    if value is None:
        if required:
            raise ConfigError("max_position_embeddings: required by this rope_type")
        return _DEFAULT_MAX_POSITIONS
    return _positive_int(value, "max_position_embeddings")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value: Any, field: str, rope_type: str | None = None) -> float:
    if value is None and rope_type is not None:
        raise ConfigError(f"{field}: required for rope_type {rope_type!r}")
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{field}: must be a number > 0, got {value!r}")
    return float(value)


def _positive_int(value: Any, field: str) -> int:
    if not _is_number(value) or value != int(value) or value <= 0:
        raise ConfigError(f"{field}: must be an integer > 0, got {value!r}")
    return int(value)


def freeze_rope_params(value: Any) -> Any:
    """A hashable equal-for-equal form of normalized rope params (lists become tuples)."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, freeze_rope_params(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze_rope_params(v) for v in value)
    return value
