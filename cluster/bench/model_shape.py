"""The built-in random model of ``cluster bench throughput``: its family, its shape (the
``--hidden-size``-style options), its parameter counts and its cached checkpoint.

Dense families (``engine.builtin.tiny_models.RANDOM_MODEL_FAMILIES``) share one shape; ``qwen3-moe``
is a random ``Qwen3MoeForCausalLM`` (``engine.builtin.tiny_moe_models.make_random_qwen3_moe``) whose
every layer is sparse: ``--intermediate-size`` is then each expert's, and ``--num-experts`` /
``--num-experts-per-tok`` pick the experts. Its defaults (16 experts, top-4, 512 per expert at the
dense bench's hidden 768 x 12 layers) make ~0.3 B parameters in all and about as many active per
token (~76 M in the decoder) as the dense bench model (~61 M), so a 2-core CPU runs it in minutes
and the MoE overhead (routing, grouping, per-expert GEMMs) shows against llama.

``deepseek-v3`` is a random ``DeepseekV3ForCausalLM``
(``engine.builtin.tiny_moe_models.make_random_deepseek_v3``): multi-head latent attention in V3's
proportions of the head size ``d`` (latent 4d, rope key d/2, q_lora 6d), layer 0 dense
(3 x ``--intermediate-size``), the others ``--num-experts`` in 4 groups plus one shared expert.
Its default 6 heads of 128 give V3's own latent, 512 + 64 values (the one size vLLM's CPU MLA
kernel compiles). MLA has no KV heads: ``--num-key-value-heads`` is the head count and cannot
be set.

``gpt-oss`` is a random ``GptOssForCausalLM``
(``engine.builtin.tiny_moe_models.make_random_gpt_oss``): gpt-oss's attention (heads of 64 with
sinks and biases, a window of 128 on every other layer, yarn) and its MoE (biased router and
experts, clamped SwiGLU) on every layer, at the ``qwen3-moe`` defaults' sizes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

DENSE_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3")
MOE_FAMILIES = ("qwen3-moe", "deepseek-v3", "gpt-oss")
# Multi-head latent attention: one latent per token and layer instead of KV heads.
MLA_FAMILIES = frozenset({"deepseek-v3"})
# DeepSeek-V3's dense first layer is this many times an expert's intermediate size.
MLA_DENSE_FACTOR = 3
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
# Gemma ties lm_head to the embedding; the others store both matrices.
TIED_FAMILIES = frozenset({"gemma2", "gemma3"})


@dataclass(frozen=True)
class ModelShape:
    """The built-in random model: its family and sizes (``head_dim = hidden / heads`` in all).
    ``num_experts`` is 0 for a dense family; for an MoE family ``intermediate_size`` is each
    expert's."""

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    intermediate_size: int = 1536
    vocab_size: int = 32000
    family: str = "llama"
    num_experts: int = 0
    num_experts_per_tok: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dirname(self) -> str:
        s = self
        experts = f"-e{s.num_experts}k{s.num_experts_per_tok}" if s.is_moe else ""
        # "-t2": the tokenizer grown to the vocabulary (older caches had 1024 tokens).
        return (
            f"bench-{s.family}-h{s.hidden_size}-l{s.num_hidden_layers}-a{s.num_attention_heads}"
            f"-kv{s.num_key_value_heads}-i{s.intermediate_size}-v{s.vocab_size}{experts}-t2"
        )

    @property
    def is_mla(self) -> bool:
        return self.family in MLA_FAMILIES

    def mla_dims(self) -> dict[str, int]:
        """The latent attention's sizes (``make_random_deepseek_v3``'s proportions)."""
        d = self.hidden_size // self.num_attention_heads
        return {
            "q_lora_rank": 6 * d,
            "kv_lora_rank": 4 * d,
            "qk_nope_head_dim": d,
            "qk_rope_head_dim": d // 2,
            "v_head_dim": d,
        }

    def kv_values_per_token(self) -> int:
        """Cached values per token and layer: MLA's latent + rope key, else K and V of every
        KV head."""
        head_dim = self.hidden_size // self.num_attention_heads
        if self.is_mla:
            dims = self.mla_dims()
            return dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
        return 2 * self.num_key_value_heads * head_dim

    def _attention_params(self) -> int:
        head_dim = self.hidden_size // self.num_attention_heads
        if self.is_mla:
            m, h, heads = self.mla_dims(), self.hidden_size, self.num_attention_heads
            q_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
            q = h * m["q_lora_rank"] + m["q_lora_rank"] * heads * q_head
            kv_a = h * (m["kv_lora_rank"] + m["qk_rope_head_dim"])
            kv_b = m["kv_lora_rank"] * heads * (m["qk_nope_head_dim"] + m["v_head_dim"])
            return q + kv_a + kv_b + heads * m["v_head_dim"] * h
        q = self.hidden_size * self.num_attention_heads * head_dim
        kv = 2 * self.hidden_size * self.num_key_value_heads * head_dim
        o = self.num_attention_heads * head_dim * self.hidden_size
        return q + kv + o

    def _mlp_params(self, num_mlps: int) -> int:
        router = self.hidden_size * self.num_experts
        return num_mlps * 3 * self.hidden_size * self.intermediate_size + router

    def _decoder_params(self, experts: int) -> int:
        """Decoder matmul parameters with ``experts`` expert MLPs counted per sparse layer
        (DeepSeek-V3: its first layer dense, one shared expert on the others)."""
        attention = self.num_hidden_layers * self._attention_params()
        if not self.is_mla:
            return attention + self.num_hidden_layers * self._mlp_params(experts)
        dense = 3 * self.hidden_size * MLA_DENSE_FACTOR * self.intermediate_size
        sparse = (self.num_hidden_layers - 1) * self._mlp_params(experts + 1)
        return attention + dense + sparse

    def linear_params_per_token(self) -> int:
        """Parameters of the matmuls every computed token goes through (decoder layers): q, k,
        v, o (MLA: its down and up projections) and a gated MLP in every family (Qwen3's q/k
        norms, Gemma2's extra norms and soft-caps are elementwise); an MoE layer's router and
        its top-k (and shared) experts."""
        return self._decoder_params(self.num_experts_per_tok if self.is_moe else 1)

    def attention_flops_per_position(self) -> int:
        """FLOPs of one query token against one cached position, over all layers: QK^T and AV
        per head (MLA absorbed: over the latent + rope key, then the latent)."""
        heads, layers = self.num_attention_heads, self.num_hidden_layers
        if self.is_mla:
            m = self.mla_dims()
            return 2 * layers * heads * (2 * m["kv_lora_rank"] + m["qk_rope_head_dim"])
        return 4 * layers * heads * (self.hidden_size // heads)

    def total_params(self) -> int:
        embeddings = 1 if self.family in TIED_FAMILIES else 2
        decoder = self._decoder_params(self.num_experts if self.is_moe else 1)
        return decoder + embeddings * self.vocab_size * self.hidden_size


# The ``--hidden-size``-style integer options; ``family`` is ``--family``.
SHAPE_DIMS = tuple(name for name in asdict(ModelShape()) if name != "family")
# Each family's defaults for the options not given.
FAMILY_SHAPES: dict[str, ModelShape] = {
    **{family: ModelShape(family=family) for family in DENSE_FAMILIES},
    "qwen3-moe": ModelShape(
        intermediate_size=512, family="qwen3-moe", num_experts=16, num_experts_per_tok=4
    ),
    # Heads of 128 as in V3, so the latent is its 512 + 64 (vLLM's CPU MLA kernel's only size).
    "deepseek-v3": ModelShape(
        num_attention_heads=6,
        num_key_value_heads=6,
        intermediate_size=512,
        family="deepseek-v3",
        num_experts=16,
        num_experts_per_tok=4,
    ),
    # gpt-oss's head size, 64.
    "gpt-oss": ModelShape(
        intermediate_size=512, family="gpt-oss", num_experts=16, num_experts_per_tok=4
    ),
}


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--family",
        choices=FAMILIES,
        default=None,
        help="architecture of the built-in random model, at the shape below (default llama; "
        "not with --model). qwen3-moe: a random Qwen3-MoE, every layer sparse, "
        "--intermediate-size per expert; by default 16 experts, top-4, 512 per expert: "
        "~0.3 B parameters, ~76 M active per token (vLLM's CPU build is the peer). "
        "deepseek-v3: a random DeepSeek-V3 (latent attention, layer 0 dense, experts in 4 "
        "groups + 1 shared), the same expert defaults. gpt-oss: a random gpt-oss (sinks, "
        "window 128 on every other layer, biased router and experts), the same defaults",
    )
    for name in SHAPE_DIMS:
        defaults = {f: getattr(s, name) for f, s in FAMILY_SHAPES.items()}
        dense, moe = defaults["llama"], defaults["qwen3-moe"]
        note = f"default {dense}" + (f", qwen3-moe {moe}" if moe != dense else "")
        if name.startswith("num_experts"):
            note = f"MoE families only, default {moe}"
        if name == "num_key_value_heads":
            note += " (deepseek-v3: the head count, latent attention has no KV heads)"
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=note)


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """``--family`` (default llama) at its defaults, with the ``--*`` options given."""
    family = args.family or ModelShape.family
    given = {name: getattr(args, name) for name in SHAPE_DIMS if getattr(args, name) is not None}
    shape = replace(FAMILY_SHAPES[family], **given)
    if family in MLA_FAMILIES:
        shape = _mla_shape(shape, kv_heads_given="num_key_value_heads" in given)
    if family in MOE_FAMILIES:
        if not 0 < shape.num_experts_per_tok <= shape.num_experts:
            raise SystemExit(
                f"--num-experts-per-tok: must be in [1, --num-experts = {shape.num_experts}], "
                f"got {shape.num_experts_per_tok}"
            )
    elif shape.num_experts or shape.num_experts_per_tok:
        raise SystemExit(
            f"--num-experts / --num-experts-per-tok: only for an MoE --family "
            f"({', '.join(MOE_FAMILIES)}), not {family}"
        )
    for name in SHAPE_DIMS:
        if not name.startswith("num_experts") and getattr(shape, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')}: must be > 0, got {getattr(shape, name)}")
    return shape


def _mla_shape(shape: ModelShape, kv_heads_given: bool) -> ModelShape:
    """The deepseek-v3 shape checked: no KV heads of its own, a head size whose rope half is
    even, experts that split into its 4 groups with top-k reachable from 2 of them."""
    if kv_heads_given:
        raise SystemExit(
            "--num-key-value-heads: deepseek-v3 has no KV heads (latent attention caches one "
            "latent per token); leave it out"
        )
    shape = replace(shape, num_key_value_heads=shape.num_attention_heads)
    head_dim = shape.hidden_size // max(shape.num_attention_heads, 1)
    if shape.hidden_size % max(shape.num_attention_heads, 1) or head_dim % 4:
        raise SystemExit(
            f"--hidden-size / --num-attention-heads: deepseek-v3 needs a head size divisible by "
            f"4 (its rope key is half a head), got {shape.hidden_size} / "
            f"{shape.num_attention_heads}"
        )
    if shape.num_experts % 4 or shape.num_experts_per_tok > shape.num_experts // 2:
        raise SystemExit(
            f"--num-experts / --num-experts-per-tok: deepseek-v3 routes within 2 of 4 expert "
            f"groups: --num-experts a multiple of 4 and --num-experts-per-tok at most half of "
            f"it, got {shape.num_experts} / {shape.num_experts_per_tok}"
        )
    return shape


def bench_model_builder(shape: ModelShape) -> Callable[[Path], Path]:
    """What writes ``shape``'s random checkpoint into a directory (for ``materialize``)."""
    if shape.is_mla:
        from engine.builtin.tiny_moe_models import make_random_deepseek_v3

        def build_mla(out: Path) -> Path:
            return make_random_deepseek_v3(
                out,
                hidden_size=shape.hidden_size,
                num_hidden_layers=shape.num_hidden_layers,
                num_attention_heads=shape.num_attention_heads,
                intermediate_size=MLA_DENSE_FACTOR * shape.intermediate_size,
                moe_intermediate_size=shape.intermediate_size,
                n_routed_experts=shape.num_experts,
                num_experts_per_tok=shape.num_experts_per_tok,
                vocab_size=shape.vocab_size,
            )

        return build_mla
    if shape.family == "gpt-oss":
        from engine.builtin.tiny_moe_models import make_random_gpt_oss

        def build_gpt_oss(out: Path) -> Path:
            return make_random_gpt_oss(
                out,
                hidden_size=shape.hidden_size,
                num_hidden_layers=shape.num_hidden_layers,
                num_attention_heads=shape.num_attention_heads,
                num_key_value_heads=shape.num_key_value_heads,
                intermediate_size=shape.intermediate_size,
                num_local_experts=shape.num_experts,
                num_experts_per_tok=shape.num_experts_per_tok,
                vocab_size=shape.vocab_size,
            )

        return build_gpt_oss
    if shape.is_moe:
        from engine.builtin.tiny_moe_models import make_random_qwen3_moe

        def build_moe(out: Path) -> Path:
            return make_random_qwen3_moe(
                out,
                hidden_size=shape.hidden_size,
                num_hidden_layers=shape.num_hidden_layers,
                num_attention_heads=shape.num_attention_heads,
                num_key_value_heads=shape.num_key_value_heads,
                moe_intermediate_size=shape.intermediate_size,
                num_experts=shape.num_experts,
                num_experts_per_tok=shape.num_experts_per_tok,
                vocab_size=shape.vocab_size,
            )

        return build_moe
    from engine.builtin.tiny_models import make_random_model

    dense = {k: v for k, v in asdict(shape).items() if not k.startswith("num_experts")}
    return lambda out: make_random_model(out, **dense)


__all__ = [
    "DENSE_FAMILIES",
    "FAMILIES",
    "FAMILY_SHAPES",
    "MLA_FAMILIES",
    "MOE_FAMILIES",
    "SHAPE_DIMS",
    "TIED_FAMILIES",
    "ModelShape",
    "add_shape_arguments",
    "bench_model_builder",
    "shape_from_args",
]
