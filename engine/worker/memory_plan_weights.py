"""One rank's parameter and buffer bytes, and its KV bytes per token, from ``config.json``
alone, for ``engine.worker.memory_plan``: exactly what the model code allocates, layer by layer
(the attention, MLP, norms, embedding and LM head of a stage; latent attention's projections;
the rotary tables; LoRA slots), on a rank's shard (``RankShape``: the sizes the parallel layers
derive from the HF config and the TP size). A mixture-of-experts feed-forward is
``engine.worker.memory_plan_moe``'s; a kept quantized format is ``KeptQuant``. Torch-free, like
the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine import hf_config
from engine.errors import ConfigError
from engine.quantization.config import keeps_mxfp4_experts
from engine.qwen_vl_config import QWEN_VL_ARCHITECTURES, vision_tower_params
from engine.rope_config import (
    freeze_rope_params,
    rope_head_dim,
    rope_max_positions,
    rope_parameters,
)
from engine.vlm_config import GEMMA3_VLM, feature_layer, is_vlm
from engine.worker import memory_plan_moe

ROTARY_TABLE_BYTES = 4  # cos/sin tables are float32 whatever the model dtype
FP32_BYTES = 4
INT64_BYTES = 8


@dataclass(frozen=True)
class Family:
    """What a family's model file builds beyond the shared decoder (``engine/models``)."""

    qkv_bias: str | bool  # an HF config key to read, or a constant
    o_bias: str | bool
    mlp_bias: str | bool
    qk_norm: str | bool
    norms_per_layer: int
    tie_default: bool  # ``CausalLM.tie_word_embeddings_default``
    flag_default: bool = False  # a flag's value when its key is absent (Qwen2-MoE's qkv_bias)

    def flag(self, hf: Mapping[str, Any], which: str | bool) -> bool:
        return bool(hf.get(which, self.flag_default)) if isinstance(which, str) else which


# Keyed like ``engine.models.MODEL_REGISTRY`` (a test checks they agree).
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("attention_bias", "attention_bias", "mlp_bias", False, 2, False),
    # The Llama decoder; its vision tower and projector are vision_tower_bytes'.
    "LlavaForConditionalGeneration": Family(
        "attention_bias", "attention_bias", "mlp_bias", False, 2, False
    ),
    "MistralForCausalLM": Family(False, False, False, False, 2, False),
    "Qwen2ForCausalLM": Family(True, False, False, False, 2, False),
    # The Qwen2 decoder; its vision tower is vision_tower_bytes'.
    "Qwen2_5_VLForConditionalGeneration": Family(True, False, False, False, 2, False),
    # The Qwen3 decoder; its vision tower (deepstack mergers too) is vision_tower_bytes'.
    "Qwen3VLForConditionalGeneration": Family(
        "attention_bias", "attention_bias", False, True, 2, False
    ),
    "Qwen3ForCausalLM": Family("attention_bias", "attention_bias", False, True, 2, False),
    "Gemma2ForCausalLM": Family("attention_bias", "attention_bias", False, False, 4, True),
    "Gemma3ForCausalLM": Family("attention_bias", "attention_bias", False, True, 4, True),
    # The Gemma 3 decoder; its SigLIP tower and projector are vision_tower_bytes'.
    "Gemma3ForConditionalGeneration": Family(
        "attention_bias", "attention_bias", False, True, 4, True
    ),
    "Phi3ForCausalLM": Family(False, False, False, False, 2, False),
    # Mixture of experts: the feed-forward is engine.worker.memory_plan_moe's.
    "MixtralForCausalLM": Family(False, False, False, False, 2, False),
    # Multi-head latent attention: its projections, biases and latent norms are _mla_layer's.
    "DeepseekV2ForCausalLM": Family(False, False, False, False, 2, False),
    "DeepseekV3ForCausalLM": Family(False, False, False, False, 2, False),
    "Qwen2MoeForCausalLM": Family("qkv_bias", False, False, False, 2, False, flag_default=True),
    "Qwen3MoeForCausalLM": Family("attention_bias", "attention_bias", False, True, 2, False),
    "Glm4MoeForCausalLM": Family("attention_bias", False, False, "use_qk_norm", 2, False),
    "GptOssForCausalLM": Family(
        "attention_bias", "attention_bias", False, False, 2, False, flag_default=True
    ),
}


# ---- shapes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention's ranks and head dims (``engine.models.mla``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    bias: bool
    interleaved_rope: bool

    @property
    def latent(self) -> int:
        """The values a token caches per layer: the latent and the shared rope key."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class RankShape:
    """The per-rank sizes the parallel layers derive from the HF config and the TP size
    (``head_dim`` is the query/key head dim, ``qk_nope + qk_rope`` under latent attention)."""

    hidden: int
    intermediate: int
    num_layers: int
    vocab: int
    head_dim: int
    heads_per_rank: int
    kv_heads_per_rank: int
    vocab_shard: int  # rows of the (padded) vocabulary per rank
    tp: int
    mla: Latent | None = None

    @property
    def q_size(self) -> int:
        return self.heads_per_rank * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads_per_rank * self.head_dim

    @property
    def inter_per_rank(self) -> int:
        return self.intermediate // self.tp


def _divide(numerator: int, tp: int, what: str) -> int:
    if numerator % tp:
        raise ConfigError(f"tensor_parallel_size: must divide {what} ({numerator}), got {tp}")
    return numerator // tp


def latent_attention(hf: Mapping[str, Any]) -> Latent | None:
    conf = dict(hf)
    arch = hf_config.architecture(conf)
    if arch not in hf_config.DEEPSEEK_ARCHITECTURES:
        return None
    field_ = functools.partial(hf_config.config_field, conf)
    return Latent(
        q_lora_rank=field_("q_lora_rank"),
        kv_lora_rank=int(field_("kv_lora_rank")),
        nope_dim=int(field_("qk_nope_head_dim")),
        rope_dim=int(field_("qk_rope_head_dim")),
        v_dim=int(field_("v_head_dim")),
        bias=bool(field_("attention_bias")),
        interleaved_rope=arch == "DeepseekV2ForCausalLM" or bool(field_("rope_interleave")),
    )


def rank_shape(hf: Mapping[str, Any], tp: int) -> RankShape:
    hidden = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    mla = latent_attention(hf)
    if mla is not None:
        # One latent "kv head", whole on every rank; the query heads split.
        kv_heads, head_dim = tp, mla.nope_dim + mla.rope_dim
    if tp >= kv_heads:
        # QKVParallelLinear replicates each KV head on tp / kv_heads ranks.
        if tp % kv_heads:
            raise ConfigError(
                f"tensor_parallel_size: must divide or be a multiple of num_key_value_heads "
                f"({kv_heads}), got {tp}"
            )
        kv_per_rank = 1
    else:
        kv_per_rank = _divide(kv_heads, tp, "num_key_value_heads")
    vocab = int(hf["vocab_size"])
    # VocabParallelEmbedding: padded to a multiple of 64 x TP when TP > 1.
    multiple = 64 * tp if tp > 1 else 1
    padded = -(-vocab // multiple) * multiple
    intermediate = int(hf["intermediate_size"])
    _divide(intermediate, tp, "intermediate_size")
    return RankShape(
        hidden=hidden,
        intermediate=intermediate,
        num_layers=int(hf["num_hidden_layers"]),
        vocab=vocab,
        head_dim=head_dim,
        heads_per_rank=_divide(heads, tp, "num_attention_heads"),
        kv_heads_per_rank=kv_per_rank,
        vocab_shard=padded // tp,
        tp=tp,
        mla=mla,
    )


# ---- weights -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeptQuant:
    """How the engine keeps a quantized linear layer's weight on the GPU
    (``engine.quantization.kept``): FP8 e4m3 with a float32 scale per output row or per block,
    or int4 packed eight to an int32 with a scale (``scale_bytes``) and, asymmetric, an int8
    zero point per row and group."""

    method: str  # "fp8" or "int4"
    bits: int
    group_size: int | None = None  # int4: input columns per scale; None: one per row
    block: tuple[int, int] | None = None  # fp8 block scales [out, in]
    zero_points: bool = False
    scale_bytes: int = 2

    def linear_bytes(self, out: int, in_: int, parts: int) -> int:
        """Bytes of one [out, in] weight shard kept in this format (``parts``: fused
        projections; each one's per-tensor scale is expanded to its rows)."""
        weight = out * in_ * self.bits // 8
        if self.method == "fp8":
            if self.block is not None:
                bo, bi = self.block
                return weight + -(-out // bo) * -(-in_ // bi) * FP32_BYTES
            return weight + out * FP32_BYTES
        groups = 1 if not self.group_size else -(-in_ // self.group_size)
        return weight + out * groups * (self.scale_bytes + (1 if self.zero_points else 0))


def stage_weight_bytes(
    hf: Mapping[str, Any],
    shape: RankShape,
    first_layer: int,
    end_layer: int,
    is_first: bool,
    is_last: bool,
    dtype_bytes: int,
    quant: KeptQuant | None = None,
    expert_parallel: bool = False,
    backend: str = "torch",
    ep_size: int | None = None,
) -> dict[str, int]:
    """Bytes of one rank's parameters, by part: exactly what the model code allocates (an
    MoE model's feed-forward by ``engine.worker.memory_plan_moe``, TP- or EP-placed; ``backend`` the
    rank's kernels, on which an MXFP4 checkpoint's experts stay MXFP4)."""
    family = FAMILIES[hf_config.architecture(hf)]
    h, q, kv, inter = shape.hidden, shape.q_size, shape.kv_size, shape.inter_per_rank
    qkv_out = q + 2 * kv

    def linear(out: int, in_: int, parts: int = 1) -> int:
        if quant is None:
            return out * in_ * dtype_bytes
        return quant.linear_bytes(out, in_, parts)

    attn = linear(qkv_out, h, 3) + linear(h, shape.heads_per_rank * shape.head_dim)
    attn_bias = 0
    if family.flag(hf, family.qkv_bias):
        attn_bias += qkv_out  # column-parallel: this rank's rows
    if family.flag(hf, family.o_bias):
        attn_bias += h  # row-parallel: whole on every rank
    mlp = linear(2 * inter, h, 2) + linear(h, inter)
    mlp_bias = 2 * inter + h if family.flag(hf, family.mlp_bias) else 0
    qk_norms = 2 * shape.head_dim if family.flag(hf, family.qk_norm) else 0
    norms = family.norms_per_layer * h + qk_norms
    if shape.mla is not None:
        attn, attn_bias, latent_norms = _mla_layer(shape, shape.mla, linear, dtype_bytes)
        norms += latent_norms
    if hf_config.architecture(hf) == hf_config.GPT_OSS:
        attn += shape.heads_per_rank * FP32_BYTES  # this rank's heads' sinks, in float32
    num_layers = end_layer - first_layer
    table = shape.vocab_shard * h * dtype_bytes
    tied = bool(hf.get("tie_word_embeddings", family.tie_default))
    parts = {
        "embedding": table if is_first else 0,
        "attention": num_layers * (attn + attn_bias * dtype_bytes),
        "mlp": num_layers * (mlp + mlp_bias * dtype_bytes),
        "norms": num_layers * norms * dtype_bytes + (h * dtype_bytes if is_last else 0),
        # A tied head shares the embedding's tensor only on a stage that has both.
        "lm_head": table if is_last and not (tied and is_first) else 0,
    }
    if is_vlm(dict(hf)):
        parts["vision"] = vision_tower_bytes(hf, dtype_bytes) if is_first else 0
    if memory_plan_moe.is_moe(hf):
        moe = memory_plan_moe.moe_weight_bytes(
            hf, first_layer, end_layer, tp=shape.tp, expert_parallel=expert_parallel,
            ep_size=ep_size, dtype_bytes=dtype_bytes, linear=linear,
            mxfp4=keeps_mxfp4_experts(hf, backend),
        )  # fmt: skip
        parts.update(moe)
    return parts


def vision_tower_bytes(hf: Mapping[str, Any], dtype_bytes: int) -> int:
    """A LLaVA's CLIP tower up to ``vision_feature_layer`` and its projector
    (``engine.models.clip``, ``engine.models.llava``), Qwen2.5-VL's tower, or Gemma 3's SigLIP
    tower and projector (``engine.models.siglip``, ``engine.models.gemma3_mm``), whole on every
    rank of stage 0."""
    if hf["architectures"][0] in QWEN_VL_ARCHITECTURES:
        return vision_tower_params(dict(hf)) * dtype_bytes
    vision = hf["vision_config"]
    d, inter, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    layer = 4 * (d * d + d) + 2 * 2 * d + (d * inter + inter) + (inter * d + d)
    if hf_config.architecture(dict(hf)) == GEMMA3_VLM:
        positions = (vision["image_size"] // patch) ** 2
        embeddings = d * vision.get("num_channels", 3) * patch * patch + d + positions * d
        projector = d * int(hf["hidden_size"]) + d  # projection + soft-embedding norm
        post_norm = 2 * d
        num_layers = vision["num_hidden_layers"]
        return (embeddings + num_layers * layer + post_norm + projector) * dtype_bytes
    positions = (vision["image_size"] // patch) ** 2 + 1
    embeddings = d + d * vision.get("num_channels", 3) * patch * patch + positions * d + 2 * d
    text = int(hf["hidden_size"])
    bias = 2 * text if hf.get("multimodal_projector_bias", True) else 0
    projector = d * text + text * text + bias
    return (embeddings + feature_layer(dict(hf)) * layer + projector) * dtype_bytes


def _mla_layer(
    shape: RankShape, mla: Latent, linear: Callable[..., int], dtype_bytes: int
) -> tuple[int, int, int]:
    """One latent-attention layer on one rank (``engine.models.mla``): its projections'
    bytes, its bias elements and its latent norms' elements. q_a_proj and kv_a_proj_with_mqa
    are whole on every rank; q_b_proj / q_proj, kv_b_proj and o_proj split by heads; kv_b_proj
    is read as dense matrices (absorbed), so it is counted in the model's dtype even where the
    others stay quantized."""
    h, heads = shape.hidden, shape.heads_per_rank
    q_out = heads * (mla.nope_dim + mla.rope_dim)
    if mla.q_lora_rank is None:
        attn = linear(q_out, h)
    else:
        attn = linear(mla.q_lora_rank, h) + linear(q_out, mla.q_lora_rank)
    attn += linear(mla.latent, h)
    attn += heads * (mla.nope_dim + mla.v_dim) * mla.kv_lora_rank * dtype_bytes
    attn += linear(h, heads * mla.v_dim)
    bias = 0
    if mla.bias:  # q_a_proj (or none), kv_a_proj_with_mqa, o_proj: all whole on every rank
        bias = (mla.q_lora_rank or 0) + mla.latent + h
    norms = (mla.q_lora_rank or 0) + mla.kv_lora_rank
    return attn, bias, norms


def rotary_buffer_bytes(hf: Mapping[str, Any], first_layer: int, end_layer: int) -> int:
    """The cos/sin tables a stage's ``RopeCache`` builds: float32 [max_position, rotary_dim]
    each, one pair per distinct rope among the stage's layer types; under latent attention
    with DeepSeek's interleaved rope, each layer's int64 ``rope_order`` too."""
    types = hf_config.layer_types(dict(hf))
    head_dim = rope_head_dim(hf) or hf["hidden_size"] // hf["num_attention_heads"]
    max_position = rope_max_positions(hf)
    distinct: dict[Any, int] = {}
    for layer_type in {types[i] for i in range(first_layer, end_layer)}:
        params = rope_parameters(hf, layer_type)
        rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        distinct[freeze_rope_params(params)] = rotary_dim
    tables = sum(2 * max_position * dim * ROTARY_TABLE_BYTES for dim in distinct.values())
    mla = latent_attention(hf)
    orders = 0
    if mla is not None and mla.interleaved_rope:
        orders = (end_layer - first_layer) * mla.rope_dim * INT64_BYTES
    return tables + orders


def lora_bytes(shape: RankShape, num_layers: int, slots: int, rank: int, dtype_bytes: int) -> int:
    """The LoRA slots ``parallel.lora.LinearLoRA`` allocates on one rank: A [slots, S x R,
    in_local] and B [slots, out_local, S x R] for qkv (S = 3), o, gate_up (S = 2) and down."""
    h, inter = shape.hidden, shape.inter_per_rank
    attn_in = shape.heads_per_rank * shape.head_dim
    per_layer = (
        3 * rank * (h + shape.q_size + 2 * shape.kv_size)  # qkv_proj: A whole, B sharded
        + rank * (attn_in + h)  # o_proj: A sharded, B whole
        + 2 * rank * (h + 2 * inter)  # gate_up_proj
        + rank * (inter + h)  # down_proj
    )
    return num_layers * slots * per_layer * dtype_bytes


def kv_bytes_per_token(shape: RankShape, num_layers: int, dtype_bytes: int) -> int:
    """K and V (or the latent) of one token on one rank: ``CacheEngine.block_bytes`` /
    block_size."""
    if shape.mla is not None:
        return num_layers * shape.mla.latent * dtype_bytes
    return num_layers * 2 * shape.kv_heads_per_rank * shape.head_dim * dtype_bytes
