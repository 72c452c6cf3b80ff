"""The feed-forward weights of a mixture-of-experts stage, for ``engine.worker.memory_plan``:
exactly what ``engine.models.moe`` / ``parallel.moe`` allocate on one rank (a dense model's MLP is
``memory_plan``'s own arithmetic). Torch-free, like the plan.

Per decoder layer of the stage (``hf_config.is_sparse_layer``: every Mixtral layer; Qwen2/3-MoE
per ``decoder_sparse_step`` and ``mlp_only_layers``; DeepSeek from ``first_k_dense_replace``)::

    dense layer    gate_up + down of intermediate_size, sliced over TP      3 H I/tp
    sparse layer   router (replicated; float32 for DeepSeek, + V3's,        E H
                   GLM's and gpt-oss's bias)
                   routed experts, TP: every expert, a slice of each        E x 3 H I_e/tp
                                   EP: E/ep whole experts (ep = tp)         E/ep x 3 H I_e
                   shared expert (Qwen2-MoE; DeepSeek's n_shared_experts    3 H S/tp
                   x I_e), TP-sliced under TP and EP
                   shared expert gate (replicated; Qwen2-MoE only)          H
                   gpt-oss's expert biases (gate_up sliced, down whole)     E x (2 I_e/tp + H)

With E divisible by the group size, TP and EP hold the same expert bytes per rank; EP trades
the slicing for whole-expert GEMMs and a skewed load when routing is unbalanced.
Quantized checkpoints (and gpt-oss's MXFP4 experts): see ``moe_weight_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine import hf_config
from engine.errors import ConfigError
from engine.quantization.config import MXFP4_GROUP

# ``linear(out, in_, parts)``: the bytes of one [out, in_] weight as the checkpoint stores it.
LinearBytes = Callable[[int, int, int], int]
FP32_BYTES = 4


def is_moe(hf: Mapping[str, Any]) -> bool:
    return hf_config.architecture(dict(hf)) in hf_config.MOE_ARCHITECTURES


def moe_weight_bytes(
    hf: Mapping[str, Any],
    first_layer: int,
    end_layer: int,
    *,
    tp: int,
    expert_parallel: bool,
    dtype_bytes: int,
    linear: LinearBytes,
    mxfp4: bool = False,
    ep_size: int | None = None,
) -> dict[str, int]:
    """One rank's feed-forward bytes over layers ``[first_layer, end_layer)``: ``mlp`` (the
    dense layers), ``experts``, ``router`` and ``shared_expert`` (with its gate); ``mxfp4``:
    the experts are kept MXFP4.

    From a quantized checkpoint the routed experts are counted in the model's dtype, as the
    loader dequantizes them; the dense layers and shared experts, linear layers, stay quantized
    on a GPU as ``linear`` says. The exception is an MXFP4 checkpoint (gpt-oss) on the Triton
    kernels (``mxfp4``), whose experts stay in the checkpoint's format
    (``_mxfp4_expert_bytes``)."""
    conf = dict(hf)
    hidden = int(hf["hidden_size"])
    num_experts = hf_config.num_experts(conf)
    expert_inter = hf_config.moe_intermediate_size(conf)
    ep = ep_size or tp
    if expert_parallel:
        if num_experts % ep:
            what = (
                "tensor_parallel_size" if ep == tp else "data_parallel_size x tensor_parallel_size"
            )
            raise ConfigError(
                f"enable_expert_parallel: needs num_experts ({num_experts}) divisible by the "
                f"EP size ({what}), got {ep}"
            )
        local_experts, expert_slice = num_experts // ep, expert_inter
    else:
        local_experts, expert_slice = num_experts, _split(expert_inter, tp, "moe intermediate")
    # The routed experts are dequantized at load (the loader keeps only linear layers
    # quantized; ``engine.quantization.loading``) unless they are MXFP4 kept as such.
    if mxfp4:
        slices = 1 if expert_parallel else tp
        expert = _mxfp4_expert_bytes(hidden, expert_inter, slices)
    else:
        expert = 3 * expert_slice * hidden * dtype_bytes
    arch = hf_config.architecture(conf)
    if arch == hf_config.GPT_OSS:
        expert += (2 * expert_slice + hidden) * dtype_bytes  # gate_up_proj_bias, down_proj_bias
    deepseek = arch in hf_config.DEEPSEEK_STYLE_MOE
    shared_size = hf_config.shared_expert_intermediate_size(conf)
    shared = 0
    if shared_size:
        shared_slice = _split(shared_size, tp, "shared_expert_intermediate_size")
        shared = linear(2 * shared_slice, hidden, 2) + linear(hidden, shared_slice, 1)
        if not deepseek:
            shared += hidden * dtype_bytes  # shared_expert_gate [1, H]
    # The router [E, H], in float32 for DeepSeek and GLM (as their HF code declares it), with
    # V3's and GLM's e_score_correction_bias [E] in float32.
    router = num_experts * hidden * (FP32_BYTES if deepseek else dtype_bytes)
    if arch in ("DeepseekV3ForCausalLM", hf_config.GLM4_MOE):
        router += num_experts * FP32_BYTES
    elif arch == hf_config.GPT_OSS:
        router += num_experts * dtype_bytes  # router.bias
    sparse = sum(hf_config.is_sparse_layer(conf, i) for i in range(first_layer, end_layer))
    dense = 0
    if sparse < end_layer - first_layer:
        dense_slice = _split(int(hf["intermediate_size"]), tp, "intermediate_size")
        dense = linear(2 * dense_slice, hidden, 2) + linear(hidden, dense_slice, 1)
    return {
        "mlp": (end_layer - first_layer - sparse) * dense,
        "experts": sparse * local_experts * expert,
        "router": sparse * router,
        "shared_expert": sparse * shared,
    }


def _mxfp4_expert_bytes(hidden: int, inter: int, slices: int) -> int:
    """One expert's MXFP4 blocks and scales on the rank holding the most of them, with its
    intermediate dim cut in ``slices``, in the checkpoint's format (``engine.models.gpt_oss``)::

        gate_up   2 I_e/tp rows x H/32 groups x (16 bytes + 1 scale byte)    (EP: 2 I_e rows)
        down      H rows x the groups covering the rank's I_e/tp inputs x 17 bytes (the
                  largest count over the ranks: a slice that starts inside a group holds it
                  whole)
    """
    size = inter // slices
    down_groups = max(
        -(-(r + 1) * size // MXFP4_GROUP) - r * size // MXFP4_GROUP for r in range(slices)
    )
    group_bytes = MXFP4_GROUP // 2 + 1
    return (2 * size * (hidden // MXFP4_GROUP) + hidden * down_groups) * group_bytes


def _split(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise ConfigError(f"tensor_parallel_size: must divide {what} ({size}), got {tp}")
    return size // tp
