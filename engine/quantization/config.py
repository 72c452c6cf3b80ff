"""``quantization_config`` (and vLLM's ``quantization="fp8"``) parsed into one scheme per
quantized linear layer; everything the engine cannot serve exactly is a ``ConfigError`` that
names it, raised while the config is read, before anything is placed.

Served: compressed-tensors checkpoints (formats float-quantized, naive-quantized,
pack-quantized): FP8 e4m3 weights with per-tensor, per-channel or [bn, bk] block scales, with
no activation quantization, dynamic per-token (or per-token-group) FP8 activations, or a static
per-tensor ``input_scale``; int4 weights (W4A16) with per-channel or group scales, symmetric or
with zero points. GPTQ (4 bit, no act-order) and AWQ (4 bit, GEMM layout) convert to the same
int4 form. Block-FP8 checkpoints in the format of DeepSeek-V3/R1, Kimi K2 and Qwen3's ``-FP8``
releases (``quant_method: fp8``, ``weight_block_size`` [bn, bk]: an e4m3 ``weight`` and a float32
``weight_scale_inv`` per block, which despite its name multiplies; ``activation_scheme:
dynamic``), every linear layer whose checkpoint holds the scale, the others as stored. Online
FP8 quantizes a float checkpoint's linear weights (per-tensor scale). MXFP4 (``quant_method:
mxfp4``, gpt-oss): only the stacked MoE experts are quantized (``engine.quantization.mxfp4``);
the linear layers are dense. Experts are dequantized at load and take no activation
quantization, so a group that gives them one is refused. An older export's
``compression_config`` is read as ``quantization_config``; the ``quantization`` argument may
also name the checkpoint's own method (``CHECKPOINT_ARGUMENTS``: vLLM's names and aliases).

Torch-free: ``engine.hf_config.check_hf_config`` runs this where only a config is read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError
from engine.model_heads import family_architecture

SUPPORTED_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "mxfp4")  # checkpoint formats
ONLINE_METHODS = ("fp8",)  # ``quantization=`` values for a float checkpoint
# vLLM's ``quantization`` values that name each checkpoint method (with its aliases and kernel
# names): a matching value serves the checkpoint as it is, as vLLM accepts it.
CHECKPOINT_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "compressed-tensors": ("compressed-tensors",),
    "gptq": ("gptq", "gptq_marlin", "auto_gptq", "marlin"),
    "awq": ("awq", "awq_marlin", "auto_awq", "marlin"),
    "fp8": ("fp8",),
    "mxfp4": ("mxfp4", "gpt_oss_mxfp4"),
}
QUANTIZATION_ARGUMENTS = tuple(dict.fromkeys(a for v in CHECKPOINT_ARGUMENTS.values() for a in v))
_CT_FORMATS = ("float-quantized", "naive-quantized", "pack-quantized")
_KEY = "quantization_config"
_LEGACY_KEY = "compression_config"  # older compressed-tensors exports
# Families whose experts a checkpoint stores stacked as ``mlp.experts.gate_up_proj`` /
# ``down_proj``, the tensors an MXFP4 checkpoint quantizes.
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)
_MXFP4_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")
MXFP4_GROUP = 32  # values per E8M0 scale


@dataclass(frozen=True)
class ActivationQuant:
    """FP8 e4m3 activation quantization: ``dynamic`` per token (``group_size``: per group of
    that many features within a token), else static with the checkpoint's ``input_scale``."""

    dynamic: bool
    group_size: int | None = None


@dataclass(frozen=True)
class QuantScheme:
    """How one linear layer's weight is stored.

    kind "fp8": e4m3 weight; ``strategy`` tensor / channel / block (``block`` = [bn, bk]).
    kind "int4": signed int4 (the compressed-tensors convention, q in [-8, 7]) with scales per
    ``group_size`` input columns (None: per output channel); ``symmetric`` False adds zero
    points. ``source`` is the checkpoint format the tensors come in.
    """

    kind: str
    strategy: str
    source: str
    block: tuple[int, int] | None = None
    group_size: int | None = None
    symmetric: bool = True
    activations: ActivationQuant | None = None
    gptq_v1_zeros: bool = False  # GPTQ v1 stores zero - 1


@dataclass(frozen=True)
class QuantConfig:
    """The schemes of a checkpoint: ``groups`` pairs each scheme with its ``targets`` (layer
    class names or ``re:`` patterns on the module name); ``ignore`` lists modules left dense."""

    method: str
    groups: tuple[tuple[tuple[str, ...], QuantScheme], ...]
    ignore: tuple[str, ...] = ()
    # GPTQ / AWQ's modules_to_not_convert name parts of module names (transformers' reading);
    # compressed-tensors' ignore names whole modules or ``re:`` patterns.
    ignore_substrings: bool = False
    # compressed-tensors' config_groups keys, aligned with ``groups`` (for messages).
    group_names: tuple[str, ...] = ()

    @property
    def online(self) -> bool:
        return bool(self.groups) and self.groups[0][1].source == "online-fp8"

    def scheme_for(self, module: str) -> QuantScheme | None:
        """The scheme of the linear layer named ``module`` (HF name, no ``.weight``), None when
        it is ignored or no group targets it."""
        if self.ignore_substrings:
            if any(part in module for part in self.ignore):
                return None
        elif any(_matches(pattern, module) for pattern in self.ignore):
            return None
        # compressed-tensors' precedence: a group naming the module exactly, then one whose
        # ``re:`` pattern matches it, then the class target.
        for exact in (True, False):
            for targets, scheme in self.groups:
                named = [t for t in targets if t != "Linear" and t.startswith("re:") != exact]
                if any(_matches(t, module) for t in named):
                    return scheme
        for targets, scheme in self.groups:
            if "Linear" in targets:
                return scheme
        return None

    def schemes(self) -> list[QuantScheme]:
        return [scheme for _, scheme in self.groups]


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern


def checkpoint_quantization(hf: Mapping[str, Any]) -> tuple[str, Any]:
    """(key, value) of the checkpoint's quantization section: ``quantization_config``, else
    the ``compression_config`` of older compressed-tensors exports (vLLM reads it too)."""
    if hf.get(_KEY) is None and hf.get(_LEGACY_KEY) is not None:
        return _LEGACY_KEY, hf[_LEGACY_KEY]
    return _KEY, hf.get(_KEY)


def parse_quantization(hf: Mapping[str, Any], online: str | None = None) -> QuantConfig | None:
    """The checkpoint's quantization (``online``: vLLM's ``quantization`` argument: online
    FP8 of a float checkpoint, or the checkpoint's own method), or None for a float checkpoint
    served as stored."""
    key, raw = checkpoint_quantization(hf)
    if online is not None:
        _check_argument(online, key, raw)
        if not raw:
            scheme = QuantScheme("fp8", "tensor", "online-fp8")
            return QuantConfig("fp8", ((("Linear",), scheme),), ignore=("lm_head",))
    if not raw:
        return None
    try:
        return _parse_checkpoint(raw, hf)
    except ConfigError as e:
        if key == _KEY:
            raise
        raise ConfigError(f"{key} (read as {_KEY}): {e}") from e


def _check_argument(online: str, key: str, raw: Any) -> None:
    """``quantization``: "fp8" for a float checkpoint, else a name of the checkpoint's method."""
    if online not in QUANTIZATION_ARGUMENTS:
        raise ConfigError(
            f"quantization: must be one of {', '.join(map(repr, QUANTIZATION_ARGUMENTS))} or "
            f"null, got {online!r}"
        )
    if not raw:
        if online not in ONLINE_METHODS:
            raise ConfigError(
                f"quantization: {online!r} names a quantized checkpoint format, but this "
                f"checkpoint has no {_KEY}; a float checkpoint is quantized at load with "
                f"{', '.join(map(repr, ONLINE_METHODS))} only"
            )
        return
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}: must be a mapping, got {raw!r}")
    method = str(raw.get("quant_method", "")).lower()
    if online not in CHECKPOINT_ARGUMENTS.get(method, ()):
        matching = CHECKPOINT_ARGUMENTS.get(method)
        allowed = f"null or one of {', '.join(map(repr, matching))}" if matching else "null"
        raise ConfigError(
            f"quantization: {online!r} does not match this checkpoint, which is already "
            f"quantized ({key}.quant_method {method!r}): set it to {allowed}"
        )


def _parse_checkpoint(raw: Any, hf: Mapping[str, Any]) -> QuantConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{_KEY}: must be a mapping, got {raw!r}")
    method = str(raw.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    if method == "fp8":
        return _fp8_blocks(raw)
    if method == "mxfp4":
        return _mxfp4(raw, hf)
    raise ConfigError(
        f"{_KEY}: quant_method {raw.get('quant_method')!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_METHODS)}; fp8 also online, quantization='fp8')"
    )


def _refuse(field: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{_KEY}.{field}: {value!r} is not supported ({allowed})")


def _positive_int(value: Any, field: str) -> int:
    """``value`` if it is an integer > 0, else a ``ConfigError`` naming ``field``."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _refuse(field, value, "a positive integer")
    return value


def _compressed_tensors(raw: Mapping[str, Any]) -> QuantConfig:
    for field in ("sparsity_config", "transform_config"):
        if raw.get(field):
            raise _refuse(field, raw[field], "must be null: not implemented")
    kv = raw.get("kv_cache_scheme")
    # FP8 per-tensor K/V scales: the attention layers take them (engine.worker.kv_cache_scales) when
    # the cache is FP8 (kv_cache_dtype), and ignore them otherwise, as vLLM does.
    fp8_tensor = ("float", 8, "tensor")
    if kv and (
        not isinstance(kv, Mapping)
        or (kv.get("type"), kv.get("num_bits"), kv.get("strategy")) != fp8_tensor
    ):
        raise _refuse("kv_cache_scheme", kv, "FP8 per-tensor (type float, 8 bits, tensor) or null")
    top_format = raw.get("format")
    groups_raw = raw.get("config_groups")
    if not isinstance(groups_raw, Mapping) or not groups_raw:
        raise ConfigError(f"{_KEY}.config_groups: must be a non-empty mapping, got {groups_raw!r}")
    groups, names = [], []
    for name, group in groups_raw.items():
        where = f"config_groups.{name}"
        if not isinstance(group, Mapping):
            raise _refuse(where, group, "a mapping")
        fmt = group.get("format") or top_format
        if fmt not in _CT_FORMATS:
            raise _refuse(f"{where}.format", fmt, f"supported: {', '.join(_CT_FORMATS)}")
        if group.get("output_activations"):
            raise _refuse(f"{where}.output_activations", group["output_activations"], "null")
        targets = group.get("targets") or []
        for target in targets:
            if target != "Linear" and not str(target).startswith("re:"):
                raise _refuse(f"{where}.targets", target, "'Linear' or 're:' patterns")
        scheme = _ct_scheme(group.get("weights"), group.get("input_activations"), fmt, where)
        groups.append((tuple(targets), scheme))
        names.append(name)
    ignore = raw.get("ignore") or []
    ignore = tuple(str(i) for i in ignore)
    return QuantConfig("compressed-tensors", tuple(groups), ignore, group_names=tuple(names))


def refuse_expert_activations(config: QuantConfig | None, experts: list[str]) -> None:
    """FP8 activation quantization runs on linear layers only: MoE experts are dequantized at
    load and their fused GEMMs take the input unquantized, which would serve a W8A8 expert as
    W8A16. A compressed-tensors group that quantizes the activations of one of ``experts``
    (module names: ``engine.hf_config.expert_modules``) is refused here, with the checkpoint's
    config, before the load."""
    if config is None or config.method != "compressed-tensors":
        return  # (fp8's block scheme keeps activations in the model dtype: nothing to refuse)
    if not any(s.activations is not None for s in config.schemes()):
        return
    names = config.group_names
    for module in experts:
        scheme = config.scheme_for(module)
        if scheme is None or scheme.activations is None:
            continue
        index = next(i for i, (_, s) in enumerate(config.groups) if s is scheme)
        where = f"config_groups.{names[index]}"
        raise ConfigError(
            f"{_KEY}.{where}.input_activations: FP8 activation quantization of MoE experts "
            f"(targets {list(config.groups[index][0])} match {module!r}) is not supported: "
            "experts run with unquantized activations; give them a group without "
            "input_activations, or ignore them"
        )


def _ct_scheme(weights: Any, acts: Any, fmt: str, where: str) -> QuantScheme:
    if not isinstance(weights, Mapping):
        raise _refuse(f"{where}.weights", weights, "weight quantization is required")
    wtype, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    if weights.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", weights["dynamic"], "false")
    if (wtype, bits) == ("float", 8):
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(f"{where}.weights.strategy", strategy, "fp8: tensor, channel, block")
        if weights.get("symmetric") is False:
            raise _refuse(f"{where}.weights.symmetric", False, "fp8 weights are symmetric")
        block = None
        if strategy == "block":
            structure = weights.get("block_structure")
            if not (isinstance(structure, list) and len(structure) == 2):
                raise _refuse(f"{where}.weights.block_structure", structure, "[rows, cols]")
            field = f"{where}.weights.block_structure"
            block = (_positive_int(structure[0], field), _positive_int(structure[1], field))
        return QuantScheme(
            "fp8", strategy, f"ct-{fmt}", block=block, activations=_ct_acts(acts, where)
        )
    if (wtype, bits) == ("int", 4):
        if acts:
            raise _refuse(f"{where}.input_activations", acts, "int4 weights: null (W4A16)")
        if strategy not in ("group", "channel"):
            raise _refuse(f"{where}.weights.strategy", strategy, "int4: group, channel")
        if weights.get("actorder") not in (None, "weight", "static"):
            # "weight" (its alias "static") only orders GPTQ's passes: groups stay in column
            # order. "group" ("dynamic") orders the groups themselves (g_idx): not implemented.
            allowed = "null, 'weight' or 'static'"
            raise _refuse(f"{where}.weights.actorder", weights["actorder"], allowed)
        group = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(group, int) or group <= 0):
            raise _refuse(f"{where}.weights.group_size", group, "a positive integer")
        symmetric = weights.get("symmetric", True) is not False
        return QuantScheme("int4", strategy, f"ct-{fmt}", group_size=group, symmetric=symmetric)
    raise _refuse(
        f"{where}.weights",
        f"{wtype} {bits}-bit",
        "supported: float 8-bit (FP8 e4m3) and int 4-bit (W4A16)",
    )


def _ct_acts(acts: Any, where: str) -> ActivationQuant | None:
    if not acts:
        return None
    key = f"{where}.input_activations"
    if not isinstance(acts, Mapping):
        raise _refuse(key, acts, "a mapping or null")
    if (acts.get("type"), acts.get("num_bits")) != ("float", 8):
        raise _refuse(key, f"{acts.get('type')} {acts.get('num_bits')}-bit", "FP8 or null")
    if acts.get("symmetric") is False:
        raise _refuse(f"{key}.symmetric", False, "true")
    strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
    if dynamic is True and strategy == "token":
        return ActivationQuant(dynamic=True)
    if dynamic is True and strategy == "group":
        group = _positive_int(acts.get("group_size"), f"{key}.group_size")
        return ActivationQuant(dynamic=True, group_size=group)
    if dynamic is False and strategy == "tensor":
        return ActivationQuant(dynamic=False)
    # A dynamic per-tensor scale spans every token of a batch: its numbers would depend on
    # which requests share a step.
    raise _refuse(
        key,
        f"strategy {strategy!r}, dynamic {dynamic!r}",
        "dynamic token or group, or static tensor",
    )


def _int4_bits(raw: Mapping[str, Any], *keys: str) -> None:
    for key in keys:
        if key in raw and raw[key] != 4:
            raise _refuse(key, raw[key], "4 bits only")


def _unquantized_lm_head(raw: Mapping[str, Any]) -> None:
    if raw.get("lm_head"):
        raise _refuse("lm_head", raw["lm_head"], "false: a quantized LM head is not implemented")


def _gptq(raw: Mapping[str, Any]) -> QuantConfig:
    _int4_bits(raw, "bits")
    _unquantized_lm_head(raw)
    if raw.get("dynamic"):
        # GPTQModel's per-module overrides (bits, group size, modules left dense).
        raise _refuse("dynamic", raw["dynamic"], "null or empty: overrides are not implemented")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "gptq, gptq_v2")
    group = raw.get("group_size", 128)
    group = None if group in (-1, None) else _positive_int(group, "group_size")
    # With one group per output channel (group_size -1) act-order changes no scale: vLLM serves
    # it as none, and the loader checks that g_idx, if stored, is all zeros.
    if raw.get("desc_act") and group is not None:
        allowed = "false, or true with group_size -1: act-order (g_idx reordering) of groups"
        raise _refuse("desc_act", raw["desc_act"], f"{allowed} is not implemented")
    scheme = QuantScheme(
        "int4",
        "group" if group else "channel",
        "gptq",
        group_size=group,
        symmetric=False,  # zero points are stored either way: served as asymmetric
        gptq_v1_zeros=fmt == "gptq",
    )
    return QuantConfig("gptq", ((("Linear",), scheme),), _ignore(raw), ignore_substrings=True)


def _awq(raw: Mapping[str, Any]) -> QuantConfig:
    _int4_bits(raw, "bits", "w_bit")
    _unquantized_lm_head(raw)
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", raw.get("version"), "gemm")
    if raw.get("zero_point") is False:
        raise _refuse("zero_point", False, "true")
    key = "group_size" if "group_size" in raw or "q_group_size" not in raw else "q_group_size"
    group = _positive_int(raw.get(key, 128), key)
    scheme = QuantScheme("int4", "group", "awq", group_size=group, symmetric=False)
    return QuantConfig("awq", ((("Linear",), scheme),), _ignore(raw), ignore_substrings=True)


def _fp8_blocks(raw: Mapping[str, Any]) -> QuantConfig:
    """``quant_method: fp8`` (transformers' FineGrainedFP8 / DeepSeek's format): block scales
    only, dynamic per-token-group activations (the GEMM's; ``kept``)."""
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, "e4m3")
    block = raw.get("weight_block_size")
    if block is None:
        raise _refuse("weight_block_size", block, "[rows, cols]: per-tensor fp8 checkpoints "
                      "are not implemented, block-scaled ones are")  # fmt: skip
    valid = isinstance(block, list | tuple) and len(block) == 2
    if not valid or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in block):
        raise _refuse("weight_block_size", block, "[rows, cols] of positive integers")
    scheme_acts = raw.get("activation_scheme", "dynamic")
    if scheme_acts != "dynamic":
        raise _refuse("activation_scheme", scheme_acts, "dynamic")
    bn, bk = int(block[0]), int(block[1])
    scheme = QuantScheme(
        "fp8", "block", "fp8-block", block=(bn, bk),
        activations=ActivationQuant(dynamic=True, group_size=bk),
    )  # fmt: skip
    return QuantConfig("fp8", ((("Linear",), scheme),), _ignore(raw), ignore_substrings=True)


def _mxfp4(raw: Mapping[str, Any], hf: Mapping[str, Any]) -> QuantConfig:
    """``quant_method: mxfp4``: the experts' ``*_blocks`` / ``*_scales``; no linear layer is
    quantized (``groups`` is empty). ``dequantize`` is a transformers loading option."""
    unknown = sorted(set(raw) - set(_MXFP4_FIELDS))
    if unknown:
        raise _refuse(unknown[0], raw[unknown[0]], f"mxfp4 reads only {', '.join(_MXFP4_FIELDS)}")
    arch = family_architecture(hf)
    if arch not in MXFP4_ARCHITECTURES:
        raise ConfigError(
            f"{_KEY}.quant_method: 'mxfp4' is served for {', '.join(MXFP4_ARCHITECTURES)} "
            f"(experts stored stacked as mlp.experts.gate_up_proj / down_proj), not {arch!r}"
        )
    ignore = tuple(str(n) for n in raw.get("modules_to_not_convert") or ())
    return QuantConfig("mxfp4", (), ignore, ignore_substrings=True)


def keeps_mxfp4_experts(hf: Mapping[str, Any], backend: str) -> bool:
    """Whether a model's experts stay MXFP4: an mxfp4 checkpoint run on the Triton kernels
    (``backend``; CUDA's), which read the format. Elsewhere they are dequantized at load."""
    _, raw = checkpoint_quantization(hf)
    mxfp4 = isinstance(raw, Mapping) and str(raw.get("quant_method", "")).lower() == "mxfp4"
    return mxfp4 and backend == "triton"


def _ignore(raw: Mapping[str, Any]) -> tuple[str, ...]:
    names = raw.get("modules_to_not_convert") or ()
    return ("lm_head", *(str(n) for n in names))
