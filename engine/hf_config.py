"""What the engine reads from a checkpoint's ``config.json``, and what it refuses there.

Torch-free on purpose: ``cluster deploy`` / ``cluster serve`` call :func:`check_hf_config` on
the deploying machine before anything is placed, and a config the engine cannot serve exactly
is refused with the field and its value — never served approximately.

Per-layer attention follows HF's ``layer_types`` (``sliding_attention`` / ``full_attention``);
configs written before that field existed get the pattern their family's HF code derives
(every layer for Mistral and Phi-3, layers from ``max_window_layers`` on for Qwen2/Qwen3, even
layers for Gemma 2, all but every ``sliding_window_pattern``-th layer for Gemma 3).
"""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError
from engine.rope_config import check_rope

SLIDING = "sliding_attention"
FULL = "full_attention"

# HF ``architectures`` names the engine builds (engine.models.MODEL_REGISTRY must agree; a
# test checks it). Kept here, torch-free, so the CLI can refuse an architecture early.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# The activation field each family's HF code reads, and the values the engine computes.
_ACTIVATION_FIELD = {
    "Gemma2ForCausalLM": "hidden_activation",
    "Gemma3ForCausalLM": "hidden_activation",
}
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("gelu_pytorch_tanh", "silu")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    return str(archs[0]) if archs else ""


def check_hf_config(hf: dict[str, Any]) -> None:
    """Raise ``ConfigError`` naming the field for anything in ``hf`` that changes the model's
    math and that the engine does not implement."""
    arch = architecture(hf)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"architectures: {arch or '(none)'!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ConfigError(
            f"quantization_config: quant_method {method!r} is not supported yet (quantized "
            "checkpoints would be served wrong, so they are refused)"
        )
    act_field = _ACTIVATION_FIELD.get(arch, "hidden_act")
    act = hidden_activation(hf)
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"{act_field}: {act!r} is not supported ({', '.join(SUPPORTED_ACTIVATIONS)})"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{key}: must be a positive integer, got {value!r}")
    if arch in _GEMMA and hf.get("use_bidirectional_attention"):
        raise ConfigError(
            "use_bidirectional_attention: true is not supported (causal decoding only)"
        )
    window = hf.get("sliding_window")
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window <= 0
    ):
        raise ConfigError(f"sliding_window: must be a positive integer or null, got {window!r}")
    types = layer_types(hf)
    explicit = hf.get("layer_types")
    if explicit is not None:
        types = [str(t) for t in explicit]
    if len(types) != hf["num_hidden_layers"]:
        raise ConfigError(
            f"layer_types: has {len(types)} entries but num_hidden_layers is "
            f"{hf['num_hidden_layers']}"
        )
    unknown = sorted({t for t in types if t not in (SLIDING, FULL)})
    if unknown:
        raise ConfigError(f"layer_types: {unknown} not supported ({SLIDING!r}, {FULL!r})")
    if SLIDING in layer_types(hf) and sliding_window(hf) is None:
        raise ConfigError("sliding_window: layer_types has sliding layers but no window is set")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = hf.get(key)
        if cap is not None and (not isinstance(cap, (int, float)) or cap <= 0):
            raise ConfigError(f"{key}: must be a positive number or null, got {cap!r}")
    if arch not in _GEMMA:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                raise ConfigError(f"{key}: {arch} does not soft-cap logits, got {hf[key]!r}")
    check_rope(hf)


def hidden_activation(hf: dict[str, Any]) -> str:
    arch = architecture(hf)
    field = _ACTIVATION_FIELD.get(arch, "hidden_act")
    default = "gelu_pytorch_tanh" if arch in _GEMMA else "silu"
    return str(hf.get(field) or default)


def sliding_window(hf: dict[str, Any]) -> int | None:
    """The window of the ``sliding_attention`` layers (keys within ``window`` positions of the
    query, itself included), or None when no layer slides."""
    window = hf.get("sliding_window")
    if not window:
        return None
    arch = architecture(hf)
    # Qwen2/Qwen3 configs carry a window that is used only with use_sliding_window.
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window"):
        return None
    return int(window)


def layer_types(hf: dict[str, Any]) -> list[str]:
    """``sliding_attention`` or ``full_attention`` for every decoder layer."""
    num_layers = int(hf["num_hidden_layers"])
    arch = architecture(hf)
    window = sliding_window(hf)
    explicit = hf.get("layer_types")
    if explicit is not None:
        types = [str(t) for t in explicit]
        # HF's Qwen2/Qwen3/Mistral ignore sliding layers when no window applies.
        if window is None and arch not in _GEMMA:
            return [FULL] * len(types)
        return types
    if arch == "Gemma2ForCausalLM":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    if arch == "Gemma3ForCausalLM":
        pattern = int(hf.get("sliding_window_pattern") or 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if window is None:
        return [FULL] * num_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(hf.get("max_window_layers") or 0)
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    return [SLIDING] * num_layers


def layer_window(hf: dict[str, Any], layer_type: str) -> int | None:
    return sliding_window(hf) if layer_type == SLIDING else None
