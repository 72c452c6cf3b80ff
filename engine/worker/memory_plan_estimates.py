"""The inputs of the memory plan (``engine.worker.memory_plan``) and its ESTIMATES: the engine
settings that change memory (``PlanSettings``), the peak a full-budget step adds on a rank
(``activation_bytes``), and CUDA memory outside torch's allocator (the context, NCCL
communicators, the decode graphs' pool: ``reserve_bytes``). Torch-free like the plan; the
worker measures the real peak at start-up and the plan's report says which lines are estimates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.worker.memory_plan_weights import RankShape

GiB = 1 << 30
MiB = 1 << 20

# ---- reserves outside torch's allocator (CUDA only; estimates) ----------------------------------
# The CUDA context of one process with torch's kernels and cuBLAS workspaces loaded: nvidia-smi
# shows 0.4-0.6 GiB per process on Hopper/Ampere before the first tensor (CUDA 12, lazy module
# loading); vLLM's profiler reports it among its "non-torch memory". An estimate.
CUDA_CONTEXT_BYTES = 512 * MiB
# Buffers NCCL allocates per communicator a rank joins (its TP group, its PP group): channels x
# NCCL_BUFFSIZE (4 MiB) per peer and protocol, a few hundred MiB on NVLink nodes (NCCL's
# documentation of NCCL_BUFFSIZE / NCCL_MAX_NCHANNELS; vLLM counts it as non-torch memory). An
# estimate; NVLS (NVLink SHARP) can take more.
NCCL_COMMUNICATOR_BYTES = 256 * MiB
# The private memory pool of the decode CUDA graphs (``engine.worker.cuda_graphs``: CUDA, Triton
# kernels, no LoRA, not enforce_eager): vLLM logs 0.2-1 GiB for "Graph capturing finished" on
# 7-70B models with up to 256 sequences. An estimate.
CUDA_GRAPH_POOL_BYTES = 512 * MiB


@dataclass(frozen=True)
class PlanSettings:
    """The engine settings that change memory, with the engine's defaults (vLLM's names; a
    test checks the defaults against ``engine.config``). ``device`` is "cuda" or "cpu" here:
    a deployment knows which from its ``accelerator_type``."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    enable_expert_parallel: bool = False
    # Engine cores of one replica, each on its own TP group with its own KV cache; the experts
    # split over all data_parallel_size x tensor_parallel_size GPUs (engine.core.data_parallel).
    data_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space: float = 4.0
    num_kv_blocks: int | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    device: str = "cuda"
    quantization: str | None = None  # online: "fp8"
    attention_backend: str = "auto"
    enforce_eager: bool = False

    @classmethod
    def from_engine_kwargs(cls, kwargs: Mapping[str, Any], device: str) -> PlanSettings:
        """Take the memory-relevant engine arguments of ``kwargs`` (others are ignored);
        ``device`` is the resolved one ("cuda" or "cpu")."""
        names = {f for f in cls.__dataclass_fields__ if f != "device"}
        picked = {k: v for k, v in kwargs.items() if k in names and v is not None}
        if picked.get("pp_layer_partition") is not None:
            picked["pp_layer_partition"] = tuple(picked["pp_layer_partition"])
        return cls(**picked, device=device)


def activation_bytes(
    shape: RankShape,
    settings: PlanSettings,
    num_batched_tokens: int,
    is_last: bool,
    dtype_bytes: int,
) -> int:
    """An ESTIMATE of the peak a full-budget step adds on one rank (``num_batched_tokens``
    tokens through one layer; layers run one after another, so one layer's worth is live):

        hidden + residual                                   2 x T x hidden
        + the larger of attention (qkv out, attention out, o_proj out) and
          MLP (gate_up out, act(gate) x up, down out)       T x (...) per rank
        + on the last stage: logits of up to max_num_seqs rows gathered over the padded
          vocabulary in the dtype, and two float32 copies the sampler makes (probabilities,
          and the sorted copy of top-k / top-p); that is TP rank 0's share, the largest,
          counted for every rank of the stage

    It ignores allocator fragmentation and the kernels' workspaces; the worker measures the
    real peak at startup (a profiling step, ``Worker._profile_run``), without the small KV
    cache that step writes into."""
    t, h = num_batched_tokens, shape.hidden
    attn = t * (shape.q_size + 2 * shape.kv_size + shape.q_size + h)
    if shape.mla is not None:  # q, the latent, the absorbed query, its output, o_proj's input
        heads, mla = shape.heads_per_rank, shape.mla
        attn = t * (shape.q_size + mla.latent + heads * (mla.latent + mla.kv_lora_rank))
        attn += t * (heads * mla.v_dim + h)
    mlp = t * (2 * shape.inter_per_rank + shape.inter_per_rank + h)
    total = (2 * t * h + max(attn, mlp)) * dtype_bytes
    if is_last:
        rows = min(settings.max_num_seqs, t)
        total += rows * shape.vocab_shard * shape.tp * dtype_bytes + 2 * rows * shape.vocab * 4
    return total


def kernel_backend(settings: PlanSettings) -> str:
    """The kernels a rank runs (``KernelConfig.resolved_backend``): Triton on CUDA unless
    attention_backend is torch; on CPU the torch path (with or without the native decode
    kernel, which allocates nothing the plan counts)."""
    if settings.device == "cuda" and settings.attention_backend != "torch":
        return "triton"
    return "torch"


def uses_cuda_graphs(settings: PlanSettings) -> bool:
    """Whether decode steps replay CUDA graphs (``engine.worker.cuda_graphs``): on CUDA with the
    Triton kernels, without LoRA, unless enforce_eager."""
    return (
        settings.device == "cuda"
        and not settings.enable_lora
        and not settings.enforce_eager
        and settings.attention_backend != "torch"
    )


def reserve_bytes(settings: PlanSettings) -> int:
    """CUDA memory outside torch's allocator on one rank (estimates, see the constants)."""
    if settings.device != "cuda":
        return 0
    communicators = (
        (settings.tensor_parallel_size > 1)
        + (settings.pipeline_parallel_size > 1)
        + (settings.data_parallel_size > 1)  # the EP group over the data-parallel ranks
    )
    graphs = CUDA_GRAPH_POOL_BYTES if uses_cuda_graphs(settings) else 0
    return CUDA_CONTEXT_BYTES + communicators * NCCL_COMMUNICATOR_BYTES + graphs
