"""What the engine reads from a checkpoint's ``config.json``, and what it refuses there.

Torch-free on purpose: ``cluster deploy`` / ``cluster serve`` call :func:`check_hf_config` on
the deploying machine before anything is placed, and a config the engine cannot serve exactly
is refused with the field and its value — never served approximately.

The readers: per-layer attention (``layer_types``, ``layer_window``), mixture-of-experts fields
(``check_moe``, ``num_experts``, ``is_sparse_layer``, ...), DeepSeek-V2/V3's latent attention
and routing (``check_deepseek``; Kimi K2 is a DeepSeek-V3), GLM-4.5 / 4.6 (``check_glm4_moe``)
and gpt-oss (``check_gpt_oss``); each says which fields it reads and what it refuses. A field
the config.json leaves out takes the default of transformers' config class for that
architecture, as HF does: the checkpoint's read fills it (``engine.hf_defaults``); fields HF
derives from others (``layer_types``, each layer type's rope) are derived here as HF does.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError, check_positive_ints
from engine.hf_defaults import hf_default
from engine.model_heads import declared_architecture, family_architecture, num_labels
from engine.quantization.config import parse_quantization, refuse_expert_activations
from engine.qwen_vl_config import QWEN2_5_VL, QWEN3_VL, QWEN_VL_ARCHITECTURES, check_qwen_vl
from engine.rope_config import check_rope
from engine.vlm_config import GEMMA3_VLM, LLAVA, check_gemma3_vlm, check_llava

SLIDING = "sliding_attention"
FULL = "full_attention"

# HF ``architectures`` names the engine builds (engine.models.MODEL_REGISTRY must agree; a
# test checks it). Kept here, torch-free, so the CLI can refuse an architecture early.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    GEMMA3_VLM,
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "LlamaForCausalLM",
    LLAVA,
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    QWEN2_5_VL,
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    QWEN3_VL,
)

# The activation field each family's HF code reads, and the values the engine computes.
_ACTIVATION_FIELD = {
    "Gemma2ForCausalLM": "hidden_activation",
    "Gemma3ForCausalLM": "hidden_activation",
    GEMMA3_VLM: "hidden_activation",
}
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("gelu_pytorch_tanh", "silu")
_GEMMA3 = ("Gemma3ForCausalLM", GEMMA3_VLM)
_GEMMA = ("Gemma2ForCausalLM", *_GEMMA3)
_QWEN_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
DEEPSEEK_ARCHITECTURES: tuple[str, ...] = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
GLM4_MOE = "Glm4MoeForCausalLM"
GPT_OSS = "GptOssForCausalLM"
# Families with DeepSeek's MoE fields: ``n_routed_experts``, ``n_shared_experts`` (ungated),
# ``first_k_dense_replace``, ``routed_scaling_factor`` and a grouped top-k.
DEEPSEEK_STYLE_MOE: tuple[str, ...] = (*DEEPSEEK_ARCHITECTURES, GLM4_MOE)
MOE_ARCHITECTURES: tuple[str, ...] = (
    "MixtralForCausalLM",
    *_QWEN_MOE,
    *DEEPSEEK_STYLE_MOE,
    GPT_OSS,
)
_UNSET_WHEN_NULL = ("topk_method", "scoring_func")
# Router options of other MoE families (DeepSeek's grouped, scaled or sigmoid routing) that
# none of these families' HF code implements: a checkpoint that sets one to anything but the
# plain softmax top-k expects routing that would be served wrong, so it is refused by name.
_FOREIGN_ROUTER_FIELDS: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "routed_scaling_factor": (1, 1.0),
    "n_group": (1,),
    "topk_group": (1,),
    "n_shared_experts": (0,),
}


def architecture(hf: dict[str, Any]) -> str:
    """The ``XForCausalLM`` family the checkpoint's decoder is, whatever head it declares
    (``engine.model_heads``): every family-keyed rule reads this name."""
    return family_architecture(hf)


def check_hf_config(hf: dict[str, Any]) -> None:
    """Raise ``ConfigError`` naming the field for anything in ``hf`` that changes the model's
    math and that the engine does not implement."""
    arch = architecture(hf)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"architectures: {declared_architecture(hf) or '(none)'!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (and their "
            "*ForSequenceClassification and *Model forms)"
        )
    num_labels(hf)  # a malformed id2label or classifier_from_token is named here
    # A quantization method or scheme the engine cannot serve exactly is refused by name.
    refuse_expert_activations(parse_quantization(hf), expert_modules(hf))
    act_field = _ACTIVATION_FIELD.get(arch, "hidden_act")
    act = hidden_activation(hf)
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"{act_field}: {act!r} is not supported ({', '.join(SUPPORTED_ACTIVATIONS)})"
        )
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    check_positive_ints(hf, sizes)
    if arch in _GEMMA and hf.get("use_bidirectional_attention"):
        raise ConfigError(
            "use_bidirectional_attention: true is not supported (causal decoding only)"
        )
    window = hf.get("sliding_window")
    # Qwen2-MoE's config writes a window of 0 when use_sliding_window is off (it means none).
    if arch in _QWEN_MOE and not hf.get("use_sliding_window"):
        window = None
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
    if arch in _GEMMA3 and hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 keeps the field but caps no attention score (no attention
        # implementation of it is passed the cap); Google's Gemma 3 code would cap them.
        raise ConfigError(
            f"attn_logit_softcapping: {hf['attn_logit_softcapping']!r} is not supported for "
            f"{arch} (transformers' Gemma 3 ignores it, so no reference serves it); allowed: null"
        )
    if arch not in _GEMMA:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                raise ConfigError(f"{key}: {arch} does not soft-cap logits, got {hf[key]!r}")
    if arch in DEEPSEEK_ARCHITECTURES:
        check_deepseek(hf)  # first: the rope check reads qk_rope_head_dim
    elif arch == GLM4_MOE:
        check_glm4_moe(hf)
    elif arch == GPT_OSS:
        check_gpt_oss(hf)
    elif arch in MOE_ARCHITECTURES:
        check_moe(hf)
    elif arch == LLAVA:
        check_llava(hf)
    elif arch == GEMMA3_VLM:
        check_gemma3_vlm(hf)
    elif arch in QWEN_VL_ARCHITECTURES:
        check_qwen_vl(hf)
    check_rope(hf)


def _positive_int(hf: dict[str, Any], key: str) -> int:
    check_positive_ints(hf, (key,))
    return hf[key]


def check_moe(hf: dict[str, Any]) -> None:
    """The MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config: counts in range, and no
    router option these families do not route with.

    The fields: the expert count (``num_experts``, ``num_local_experts`` as Mixtral and
    transformers' Qwen3-MoE config write it, or DeepSeek's ``n_routed_experts``), top-k, the
    experts' intermediate size, which layers are sparse (``decoder_sparse_step``,
    ``mlp_only_layers``; DeepSeek's ``first_k_dense_replace``); router options of other
    families (DeepSeek's ``scoring_func``, ``routed_scaling_factor``, grouped top-k) are refused
    by name where the family does not route with them."""
    arch = architecture(hf)
    key = "num_local_experts" if arch == "MixtralForCausalLM" else "num_experts"
    experts = num_experts(hf)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts <= 0:
        raise ConfigError(f"{key}: must be a positive integer, got {experts!r}")
    top_k = _positive_int(hf, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} is more than the {experts} experts")
    moe_key = "intermediate_size" if arch == "MixtralForCausalLM" else "moe_intermediate_size"
    _positive_int(hf, moe_key)
    for field, allowed in _FOREIGN_ROUTER_FIELDS.items():
        value = hf.get(field)
        if value is not None and value not in allowed:
            raise ConfigError(
                f"{field}: {value!r} is not supported ({arch} routes by softmax top-k; "
                f"allowed: {', '.join(repr(a) for a in allowed)} or unset)"
            )
    if arch not in _QWEN_MOE:
        return
    if hf.get("use_sliding_window"):
        raise ConfigError(f"use_sliding_window: true is not supported for {arch} yet")
    if "decoder_sparse_step" in hf:
        _positive_int(hf, "decoder_sparse_step")
    only = hf.get("mlp_only_layers") or []
    layers = hf["num_hidden_layers"]
    if not isinstance(only, list) or any(
        not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers for i in only
    ):
        raise ConfigError(f"mlp_only_layers: must be layer indices in [0, {layers}), got {only!r}")
    if arch == "Qwen2MoeForCausalLM":
        _positive_int(hf, "shared_expert_intermediate_size")


def config_field(hf: dict[str, Any], key: str) -> Any:
    """A config field, or transformers' default for the architecture when absent
    (``engine.hf_defaults.hf_default``), or null where null means unset: transformers' V3 code
    has no ``topk_method`` / ``scoring_func`` of its own and writes them out as null."""
    if key in hf and not (hf[key] is None and key in _UNSET_WHEN_NULL):
        return hf[key]
    return hf_default(hf, key)


def _natural(hf: dict[str, Any], key: str, *, positive: bool = True) -> int:
    value = config_field(hf, key)
    low = 1 if positive else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        kind = "a positive integer" if positive else "an integer >= 0"
        raise ConfigError(f"{key}: must be {kind}, got {value!r}")
    return value


def check_deepseek(hf: dict[str, Any]) -> None:
    """A DeepSeek-V2 / V3 config (and Kimi K2, a DeepSeek-V3): the latent attention's ranks and
    head dims (``kv_lora_rank``, ``q_lora_rank`` or null, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``), the MoE counts, and routing options the engine
    computes as HF does (``deepseek_routing``)."""
    arch = architecture(hf)
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        _natural(hf, key)
    rope_dim = _natural(hf, "qk_rope_head_dim")
    if rope_dim % 2:
        raise ConfigError(f"qk_rope_head_dim: must be even, got {rope_dim}")
    if config_field(hf, "q_lora_rank") is not None:
        _natural(hf, "q_lora_rank")
    experts, top_k = _check_deepseek_style_experts(hf)
    freq = hf.get("moe_layer_freq", 1)
    if freq != 1:
        raise ConfigError(f"moe_layer_freq: only 1 is supported (as HF computes), got {freq!r}")
    _check_flags(hf, "rope_interleave", "attention_bias", "norm_topk_prob")
    v2 = arch == "DeepseekV2ForCausalLM"
    methods = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    scoring = "softmax" if v2 else "sigmoid"
    method = config_field(hf, "topk_method")
    if method not in methods:
        raise ConfigError(f"topk_method: {method!r} is not supported for {arch} ({methods})")
    if config_field(hf, "scoring_func") != scoring:
        raise ConfigError(f"scoring_func: {arch} scores experts by {scoring!r}, got "
                          f"{config_field(hf, 'scoring_func')!r}")  # fmt: skip
    if v2 and config_field(hf, "norm_topk_prob"):
        # transformers' DeepSeek-V2 router never renormalizes, DeepSeek's own code does.
        raise ConfigError("norm_topk_prob: true is not supported for DeepseekV2ForCausalLM "
                          "(transformers' and DeepSeek's code disagree on it)")  # fmt: skip
    if method in ("group_limited_greedy", "noaux_tc"):
        _check_groups(hf, experts, top_k, top2=method == "noaux_tc")


def check_glm4_moe(hf: dict[str, Any]) -> None:
    """A GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``) config: DeepSeek-V3's router (sigmoid scores,
    correction bias, groups scored by their best two) over ``n_routed_experts``, shared
    experts, dense first layers; the attention flags it switches on grouped-query attention
    (``use_qk_norm``, ``attention_bias``, half the head rotated by default)."""
    experts, top_k = _check_deepseek_style_experts(hf)
    _check_flags(hf, "attention_bias", "norm_topk_prob", "use_qk_norm")
    _check_groups(hf, experts, top_k, top2=True)


def check_gpt_oss(hf: dict[str, Any]) -> None:
    """A gpt-oss config: ``num_local_experts`` experts of ``intermediate_size``, top-k in
    range, and the clamped SwiGLU's ``swiglu_limit`` (and ``swiglu_alpha`` when set)."""
    experts = _positive_int(hf, "num_local_experts")
    top_k = _positive_int(hf, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} is more than the {experts} experts")
    _positive_int(hf, "intermediate_size")
    for key in ("swiglu_limit", "swiglu_alpha"):
        value = hf.get(key)
        if key == "swiglu_alpha" and value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"{key}: must be a number > 0, got {value!r}")
    if not isinstance(hf.get("attention_bias", True), bool):
        raise ConfigError(f"attention_bias: must be true or false, got {hf['attention_bias']!r}")


def _check_deepseek_style_experts(hf: dict[str, Any]) -> tuple[int, int]:
    """The expert counts, dense layers and scaling of a DeepSeek-style MoE: (experts, top-k)."""
    _natural(hf, "moe_intermediate_size")
    experts = _natural(hf, "n_routed_experts")
    top_k = _positive_int(hf, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} is more than the {experts} experts")
    _natural(hf, "n_shared_experts", positive=False)
    _natural(hf, "first_k_dense_replace", positive=False)
    scale = config_field(hf, "routed_scaling_factor")
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not scale > 0:
        raise ConfigError(f"routed_scaling_factor: must be a number > 0, got {scale!r}")
    return experts, top_k


def _check_flags(hf: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if not isinstance(config_field(hf, key), bool):
            raise ConfigError(f"{key}: must be true or false, got {config_field(hf, key)!r}")


def _check_groups(hf: dict[str, Any], experts: int, top_k: int, *, top2: bool) -> None:
    """``n_group`` / ``topk_group`` of a grouped top-k (``top2``: groups scored by their best
    two experts, DeepSeek-V3's ``noaux_tc`` and GLM's router)."""
    groups, best = _natural(hf, "n_group"), _natural(hf, "topk_group")
    if experts % groups:
        raise ConfigError(f"n_group: {groups} does not divide n_routed_experts {experts}")
    if best > groups:
        raise ConfigError(f"topk_group: {best} is more than n_group {groups}")
    if top2 and experts // groups < 2:
        raise ConfigError(f"n_group: {groups} leaves fewer than 2 experts per group "
                          "(the router scores a group by its best two)")  # fmt: skip
    allowed = best * (experts // groups)
    if top_k > allowed:
        raise ConfigError(f"num_experts_per_tok: {top_k} is more than the {allowed} "
                          "experts of topk_group groups")  # fmt: skip


def num_experts(hf: dict[str, Any]) -> int:
    """Routed experts per sparse layer: ``num_experts`` (Qwen2/3-MoE), ``num_local_experts``
    (Mixtral; transformers also writes Qwen3-MoE's under this name) or ``n_routed_experts``
    (DeepSeek)."""
    if architecture(hf) in DEEPSEEK_STYLE_MOE:
        return int(config_field(hf, "n_routed_experts"))
    value = hf.get("num_experts")
    return value if value is not None else hf.get("num_local_experts", 0)


def moe_intermediate_size(hf: dict[str, Any]) -> int:
    """Each routed expert's intermediate size (``intermediate_size`` for Mixtral, gpt-oss)."""
    arch = architecture(hf)
    if arch in ("MixtralForCausalLM", GPT_OSS):
        return int(hf["intermediate_size"])
    if arch in DEEPSEEK_STYLE_MOE:
        return int(config_field(hf, "moe_intermediate_size"))
    return int(hf["moe_intermediate_size"])


def shared_expert_intermediate_size(hf: dict[str, Any]) -> int:
    """The always-on shared expert's intermediate size on a sparse layer (0: none): Qwen2-MoE's
    ``shared_expert_intermediate_size`` (Qwen3-MoE's config may carry the field; its model has
    no shared expert), DeepSeek's and GLM-4.5's ``n_shared_experts`` x each expert's size."""
    arch = architecture(hf)
    if arch in DEEPSEEK_STYLE_MOE:
        return int(config_field(hf, "n_shared_experts")) * moe_intermediate_size(hf)
    if arch == "Qwen2MoeForCausalLM":
        return int(hf.get("shared_expert_intermediate_size") or 0)
    return 0


def is_sparse_layer(hf: dict[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` holds the MoE block (else a dense MLP): every layer of
    Mixtral and gpt-oss; for Qwen2/3-MoE HF's rule — not in ``mlp_only_layers``, and every
    ``decoder_sparse_step``-th layer (1-based) when there are experts at all; for DeepSeek and
    GLM-4.5 every layer from ``first_k_dense_replace`` on."""
    arch = architecture(hf)
    if arch in ("MixtralForCausalLM", GPT_OSS):
        return True
    if arch in DEEPSEEK_STYLE_MOE:
        return layer >= int(config_field(hf, "first_k_dense_replace"))
    if arch not in _QWEN_MOE:
        return False
    step = int(hf.get("decoder_sparse_step") or 1)
    only = hf.get("mlp_only_layers") or []
    return layer not in only and num_experts(hf) > 0 and (layer + 1) % step == 0


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
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", *_QWEN_MOE) and not hf.get(
        "use_sliding_window"
    ):
        return None
    return int(window)


def layer_types(hf: dict[str, Any]) -> list[str]:
    """``sliding_attention`` or ``full_attention`` for every decoder layer, as HF's
    ``layer_types`` says; configs written before that field existed get the pattern their
    family's HF code derives (every layer for Mistral and Phi-3, layers from
    ``max_window_layers`` on for Qwen2/Qwen3, even layers for Gemma 2 and gpt-oss, all but every
    ``sliding_window_pattern``-th layer for Gemma 3; every layer for Mixtral). Qwen2-MoE /
    Qwen3-MoE with ``use_sliding_window`` are refused (``check_moe``): their HF patterns
    differ from Qwen2's and are not implemented."""
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
    if arch in ("Gemma2ForCausalLM", GPT_OSS):
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    if arch in _GEMMA3:
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


def expert_modules(hf: dict[str, Any]) -> list[str]:
    """The checkpoint module names of an MoE model's routed experts (per sparse layer: the
    first and last expert's projections, or the stacked ones of gpt-oss); empty for a dense
    model. Config groups tell experts apart by layer and projection, not by index; a group
    that singles out a middle expert is still refused at load (``engine.quantization.loading``)."""
    conf = dict(hf)
    arch = architecture(conf)
    if arch not in MOE_ARCHITECTURES:
        return []
    experts = int(num_experts(conf) or 0)
    if arch == GPT_OSS:
        suffixes = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    else:
        mixtral = arch == "MixtralForCausalLM"
        parent = "block_sparse_moe" if mixtral else "mlp"
        projections = ("w1", "w2", "w3") if mixtral else ("gate_proj", "up_proj", "down_proj")
        ends = sorted({0, max(experts - 1, 0)})
        suffixes = [f"{parent}.experts.{e}.{p}" for e in ends for p in projections]
    return [
        f"model.layers.{layer}.{suffix}"
        for layer in range(int(conf.get("num_hidden_layers") or 0))
        if is_sparse_layer(conf, layer)
        for suffix in suffixes
    ]
