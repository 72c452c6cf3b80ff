"""Whether a model fits its GPUs, decided from ``config.json`` and the engine settings alone,
before anything is placed: what ``cluster plan`` prints and ``cluster deploy`` refuses on.

Torch-free on purpose (the CLI and the deploying driver import it): pure arithmetic that
mirrors what the model code allocates, per pipeline stage (every TP rank of a stage holds
shards of the same sizes, so one line per stage stands for all of its ranks):

    weights + buffers + lora    exact: the parameters, rotary tables and LoRA slots a rank
                                builds (``memory_plan_weights``; MoE: ``memory_plan_moe``)
    activation + reserves       ESTIMATES: a full-budget step's peak, CUDA outside torch
                                (``memory_plan_estimates``, with the settings it reads)
    kv                          bytes per token and the blocks that fit in what is left,
                                split into KV cache groups as ``engine.core.kv_cache_groups`` does

The refusals read the same figures as the report, so both live here: ``plan_memory`` builds a
``MemoryPlan`` (whose docstring details each line, quantized checkpoints and the refusals),
``memory_problems`` lists what it refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine import hf_config
from engine.core.kv_cache_groups import (
    KVCacheGroupSpec,
    group_of_window,
    kv_cache_group_specs,
    plan_group_blocks,
    sliding_blocks_per_seq,
)
from engine.errors import ConfigError
from engine.hf_defaults import with_hf_defaults
from engine.pp_partition import layer_partition, requested_partition, stage_layer_range
from engine.quantization.config import parse_quantization
from engine.rope_config import rope_max_positions
from engine.vlm_config import flatten_vlm_config
from engine.worker.memory_plan_estimates import (
    GiB,
    PlanSettings,
    activation_bytes,
    kernel_backend,
    reserve_bytes,
)
from engine.worker.memory_plan_weights import (
    FAMILIES,
    KeptQuant,
    RankShape,
    kv_bytes_per_token,
    lora_bytes,
    rank_shape,
    rotary_buffer_bytes,
    stage_weight_bytes,
)

# Bytes per element of the dtypes ``engine.config_sections`` accepts (its ``_DTYPES``).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
}
_CANONICAL_DTYPE = {"float": "float32", "half": "float16"}


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage; each of its ``tensor_parallel_size`` GPUs holds these bytes."""

    pp_rank: int
    first_layer: int
    end_layer: int  # exclusive
    weight_bytes: int
    weight_breakdown: dict[str, int]
    buffer_bytes: int
    lora_bytes: int
    activation_bytes: int  # an estimate
    reserve_bytes: int  # an estimate; 0 on CPU
    kv_bytes_per_token: int
    kv_block_bytes: int
    # Of kv_bytes_per_token, each KV cache group's (MemoryPlan.kv_groups' order).
    kv_group_bytes_per_token: tuple[int, ...]
    kv_budget_bytes: int | None  # GPU: usable memory left for the KV cache; None when unknown
    kv_blocks: int | None  # blocks this stage's GPUs hold; None when unknown

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    @property
    def fixed_bytes(self) -> int:
        """Everything but the KV cache."""
        return (
            self.weight_bytes
            + self.buffer_bytes
            + self.lora_bytes
            + self.activation_bytes
            + self.reserve_bytes
        )


@dataclass(frozen=True)
class KVGroupPlan:
    """One KV cache group across the replica: its window (None: full attention), layers, KV
    bytes per token (all its layers, the largest stage's share per GPU) and pool blocks."""

    sliding_window: int | None
    num_layers: int
    bytes_per_token: int
    blocks: int | None


@dataclass(frozen=True)
class MemoryPlan:
    """One replica's memory, per pipeline stage, line by line::

        weights      exactly the parameters a rank builds (``parallel.layers``: vocab rows
                     padded to 64 x TP, column/row/QKV/merged splits, KV heads replicated when
                     TP > KV heads, row-parallel biases whole on every rank; ``engine.models``:
                     which layers and norms each family has, each stage's layers per
                     ``engine.pp_partition``, embedding on the first stage, final norm and LM
                     head on the last, a tied head sharing the embedding only when one stage
                     holds both; an MoE model's experts, router and shared expert per
                     ``engine.worker.memory_plan_moe``, sliced over TP or placed whole per rank
                     under enable_expert_parallel)
        buffers      exactly the rotary cos/sin tables (``RopeCache``: float32 [max_position,
                     rotary_dim], one pair per distinct rope among this stage's layers)
        lora         exactly the LoRA slots (``parallel.lora.LinearLoRA``) when enable_lora
        activation   an ESTIMATE of a full-budget step's peak (see ``activation_bytes``)
        reserves     an ESTIMATE of what CUDA holds outside torch's allocator (context, NCCL,
                     the CUDA-graph pool); named constants, each saying where its figure comes
                     from
        kv           bytes per token = layers x 2 (K, V) x KV heads of this rank x head_dim x
                     dtype bytes, or with multi-head latent attention (DeepSeek) layers x
                     (kv_lora_rank + qk_rope_head_dim) x dtype bytes, the same latent on every
                     TP rank (``PagedAttention.kv_cache_shape``), and the blocks that fit:

            GPU:  (memory x gpu_memory_utilization - weights - buffers - lora - activation
                   - reserves) // (block_size x bytes per token), the minimum over stages
            CPU:  min(cpu_kv_cache_space GiB // block bytes, max_num_seqs x blocks of
                  max_model_len) (``Worker.determine_num_available_blocks``)

                     then, with sliding-window layers, those all-layer blocks split into KV
                     cache groups as the engine splits them (``engine.core.kv_cache_groups``): KV
                     per token per group, each group's blocks, and the max_model_len sequences that
                     fit (the fewest over groups; a sliding group holds only its window of each)

    A plan refuses (``problems``) when the weights and buffers do not fit a GPU's usable memory,
    when the KV cache cannot hold one ``max_model_len`` sequence, or when the engine would
    refuse the config itself (``engine.hf_config.check_hf_config``). Quantized checkpoints
    (compressed-tensors, GPTQ, AWQ, online ``quantization: fp8``) are planned as the engine
    keeps them on a GPU: FP8 at 1 byte per parameter plus float32 scales per row or block, int4
    at half a byte plus a scale (and zero point) per group; on CPU, which dequantizes at load,
    in the model's dtype, with a note. MXFP4 experts (gpt-oss) likewise: half a byte per weight
    and a byte per 32 on the Triton kernels (CUDA), dequantized elsewhere (``memory_plan_moe``).
    """

    architecture: str
    dtype: str
    device: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    gpu_memory_utilization: float
    gpu_memory_bytes: int | None
    stages: tuple[StagePlan, ...]
    kv_blocks: int | None  # per replica: the minimum over its GPUs
    problems: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    # KV cache groups (one for a model without sliding windows shorter than max_model_len).
    kv_groups: tuple[KVGroupPlan, ...] = field(default=())
    # Engine cores of the replica, each its TP group (the GPU figures of ``stages``) and its
    # own KV cache of ``kv_blocks``.
    data_parallel_size: int = 1

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def kv_tokens(self) -> int | None:
        """Tokens one sequence may hold: the KV blocks', or with KV cache groups the full
        attention group's (a sliding group holds any length's window)."""
        if self.kv_blocks is None:
            return None
        full = [g.blocks for g in self.kv_groups if g.sliding_window is None and g.blocks]
        if len(self.kv_groups) > 1 and full:
            return min(full) * self.block_size
        return self.kv_blocks * self.block_size

    @property
    def max_concurrent_sequences(self) -> int | None:
        """Sequences of ``max_model_len`` tokens the replica's KV cache holds at once: the
        fewest any KV cache group holds (a sliding group, one decode step's window of each),
        times its data-parallel cores."""
        per_core = self._sequences_per_core()
        return None if per_core is None else per_core * self.data_parallel_size

    def _sequences_per_core(self) -> int | None:
        tokens = self.kv_tokens
        if tokens is None:
            return None
        if len(self.kv_groups) <= 1:
            return tokens // self.max_model_len
        fits = []
        for group in self.kv_groups:
            blocks = group.blocks or 0
            if group.sliding_window is None:
                fits.append(blocks * self.block_size // self.max_model_len)
            else:
                per_seq = sliding_blocks_per_seq(group.sliding_window, self.block_size, 1)
                fits.append((blocks - 1) // min(per_seq, -(-self.max_model_len // self.block_size)))
        return min(fits)

    @property
    def usable_gpu_bytes(self) -> int | None:
        if self.gpu_memory_bytes is None:
            return None
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["fits"] = self.fits
        data["kv_tokens"] = self.kv_tokens
        data["longest_sequence_tokens"] = self.kv_tokens
        data["max_concurrent_sequences"] = self.max_concurrent_sequences
        data["usable_gpu_bytes"] = self.usable_gpu_bytes
        for stage, obj in zip(data["stages"], self.stages):
            stage["num_layers"] = obj.num_layers
            stage["fixed_bytes"] = obj.fixed_bytes
        return data


# ---- weights -----------------------------------------------------------------------------------


def _quant(
    hf: Mapping[str, Any], settings: PlanSettings, dtype_bytes: int
) -> tuple[KeptQuant | None, str | None]:
    """The linear weights' format on the device and, where the plan counts them dense although
    the checkpoint is quantized, a note saying why."""
    try:
        quant = parse_quantization(hf, settings.quantization)
    except ConfigError:
        return None, None  # refused: check_hf_config's problem says so
    if quant is None:
        return None, None
    if not quant.groups:  # MXFP4: the experts alone, which memory_plan_moe counts
        if kernel_backend(settings) == "triton":
            return None, None
        where = "on CPU" if settings.device != "cuda" else "with attention_backend torch"
        return None, (
            f"mxfp4 experts counted dequantized in the model's dtype: the engine dequantizes "
            f"them at load {where} (the Triton kernels on CUDA keep them MXFP4)"
        )
    if settings.device != "cuda":
        return None, (
            f"{quant.method} weights counted dequantized: on CPU the engine dequantizes them "
            "once at load, which saves no memory (LLM_CLUSTER_CPU_KEEP_QUANTIZED=1 keeps them)"
        )
    scheme = quant.schemes()[0]
    if any(s.kind != scheme.kind for s in quant.schemes()):
        return None, "mixed quantization schemes not modelled: linear weights counted dense"
    if scheme.kind == "fp8":
        return KeptQuant("fp8", 8, block=scheme.block), None
    # GPTQ / AWQ scales are float16; compressed-tensors writes them in the model's dtype.
    scale_bytes = 2 if scheme.source in ("gptq", "awq") else dtype_bytes
    return (
        KeptQuant(
            "int4",
            4,
            group_size=scheme.group_size,
            zero_points=not scheme.symmetric,
            scale_bytes=scale_bytes,
        ),
        None,
    )


# ---- the plan ----------------------------------------------------------------------------------


def resolve_dtype(hf: Mapping[str, Any], dtype: str) -> str:
    """``ModelConfig.torch_dtype``'s rule: "auto" takes the checkpoint's dtype (float32 when
    it names none, or one the engine does not know)."""
    if dtype == "auto":
        name = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").removeprefix("torch.")
        dtype = name if name in DTYPE_BYTES else "float32"
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype: must be 'auto' or one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return _CANONICAL_DTYPE.get(dtype, dtype)


def plan_memory(
    hf: Mapping[str, Any], settings: PlanSettings, gpu_memory_bytes: int | None = None
) -> MemoryPlan:
    """The memory plan of one replica of the model in ``hf`` (a ``config.json`` dict) under
    ``settings``; ``gpu_memory_bytes`` is one GPU's total memory (None: unknown, and the checks
    that need it are skipped). Never raises for what it can report: a config the engine refuses
    is one of ``problems``; one the plan cannot even size has no stages."""
    problems: list[str] = []
    notes: list[str] = []
    # A VLM's nested config, and the fields a config leaves out, read as the engine reads them.
    hf = with_hf_defaults(flatten_vlm_config(dict(hf)))
    try:
        hf_config.check_hf_config(dict(hf))
    except ConfigError as exc:
        problems.append(f"config.json: {exc}")
    try:
        return _plan(hf, settings, gpu_memory_bytes, problems, notes)
    except (ConfigError, KeyError, IndexError, TypeError, ValueError) as exc:
        reason = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        message = f"cannot size the model: {reason}"
        if not any(reason in p for p in problems):
            problems.append(message)
        return MemoryPlan(
            architecture=hf_config.architecture(dict(hf)),
            dtype=str(settings.dtype),
            device=settings.device,
            tensor_parallel_size=settings.tensor_parallel_size,
            pipeline_parallel_size=settings.pipeline_parallel_size,
            max_model_len=settings.max_model_len or 0,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens or 0,
            block_size=settings.block_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            gpu_memory_bytes=gpu_memory_bytes,
            stages=(),
            kv_blocks=None,
            problems=tuple(problems),
            notes=tuple(notes),
        )


def _plan(
    hf: Mapping[str, Any],
    settings: PlanSettings,
    gpu_memory_bytes: int | None,
    problems: list[str],
    notes: list[str],
) -> MemoryPlan:
    arch = hf_config.architecture(dict(hf))
    if arch not in FAMILIES:
        raise ConfigError(f"architectures: {arch or '(none)'!r} has no memory model")
    dtype = resolve_dtype(hf, settings.dtype)
    dtype_bytes = DTYPE_BYTES[dtype]
    tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
    shape = rank_shape(hf, tp)
    limit = rope_max_positions(hf)
    max_model_len = settings.max_model_len or limit
    if max_model_len > limit:
        problems.append(
            f"max_model_len: must be <= {limit} (the model's max_position_embeddings, with "
            f"rope scaling), got {max_model_len}"
        )
    batched = settings.max_num_batched_tokens
    if batched is None:
        batched = 2048 if settings.enable_chunked_prefill else max(2048, max_model_len)
    if pp > shape.num_layers:
        raise ConfigError(
            f"pipeline_parallel_size: must be <= num_hidden_layers ({shape.num_layers}), got {pp}"
        )
    requested = requested_partition(settings.pp_layer_partition, pp, shape.num_layers)
    partition = layer_partition(hf, pp, requested)
    quant, note = _quant(hf, settings, dtype_bytes)
    if note:
        notes.append(note)
    usable = (
        None
        if gpu_memory_bytes is None
        else int(gpu_memory_bytes * settings.gpu_memory_utilization)
    )
    if settings.device == "cuda" and gpu_memory_bytes is None:
        notes.append("GPU memory unknown: the checks against it are skipped")
    stages = [
        _with_kv(
            _stage(hf, shape, settings, pp_rank, partition, dtype_bytes, batched, quant),
            settings,
            max_model_len,
            usable,
        )
        for pp_rank in range(pp)
    ]
    known = [s.kv_blocks for s in stages if s.kv_blocks is not None]
    kv_blocks = min(known) if len(known) == len(stages) else None
    plan = MemoryPlan(
        architecture=arch,
        dtype=dtype,
        device=settings.device,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_model_len=max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=batched,
        block_size=settings.block_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        gpu_memory_bytes=gpu_memory_bytes if settings.device == "cuda" else None,
        stages=tuple(stages),
        kv_blocks=kv_blocks,
        problems=(),
        notes=tuple(notes),
        kv_groups=_kv_groups(hf, settings, stages, kv_blocks, max_model_len, batched),
        data_parallel_size=settings.data_parallel_size,
    )
    problems.extend(memory_problems(plan, settings))
    return replace(plan, problems=tuple(problems))


def _stage(
    hf: Mapping[str, Any],
    shape: RankShape,
    settings: PlanSettings,
    pp_rank: int,
    partition: tuple[int, ...],
    dtype_bytes: int,
    batched: int,
    quant: KeptQuant | None,
) -> StagePlan:
    """One stage's figures, without its KV blocks (``_with_kv``)."""
    pp = settings.pipeline_parallel_size
    first, end = stage_layer_range(partition, pp_rank)
    is_last = pp_rank == pp - 1
    weights = stage_weight_bytes(
        hf, shape, first, end, pp_rank == 0, is_last, dtype_bytes, quant,
        expert_parallel=settings.enable_expert_parallel, backend=kernel_backend(settings),
        ep_size=settings.tensor_parallel_size * settings.data_parallel_size,
    )  # fmt: skip
    # An FP8 KV cache (kv_cache_dtype fp8 / fp8_e4m3) stores 1 byte per element.
    kv_dtype_bytes = dtype_bytes if settings.kv_cache_dtype == "auto" else 1
    per_token = kv_bytes_per_token(shape, end - first, kv_dtype_bytes)
    specs = _group_specs(hf, settings)
    per_group = [0] * len(specs)
    for layer in range(first, end):
        per_group[_layer_group(hf, specs, layer, settings)] += kv_bytes_per_token(
            shape, 1, kv_dtype_bytes
        )
    lora = 0
    if settings.enable_lora:
        lora = lora_bytes(
            shape, end - first, settings.max_loras, settings.max_lora_rank, dtype_bytes
        )
    return StagePlan(
        pp_rank=pp_rank,
        first_layer=first,
        end_layer=end,
        weight_bytes=sum(weights.values()),
        weight_breakdown=weights,
        buffer_bytes=rotary_buffer_bytes(hf, first, end),
        lora_bytes=lora,
        activation_bytes=activation_bytes(shape, settings, batched, is_last, dtype_bytes),
        reserve_bytes=reserve_bytes(settings),
        kv_bytes_per_token=per_token,
        kv_block_bytes=per_token * settings.block_size,
        kv_group_bytes_per_token=tuple(per_group),
        kv_budget_bytes=None,
        kv_blocks=None,
    )


def _group_specs(hf: Mapping[str, Any], settings: PlanSettings) -> tuple[KVCacheGroupSpec, ...]:
    max_model_len = settings.max_model_len or rope_max_positions(hf)
    return kv_cache_group_specs(dict(hf), max_model_len)


def _layer_group(
    hf: Mapping[str, Any], specs: tuple[KVCacheGroupSpec, ...], layer: int, settings: PlanSettings
) -> int:
    layer_type = hf_config.layer_types(dict(hf))[layer]
    max_model_len = settings.max_model_len or rope_max_positions(hf)
    return group_of_window(specs, hf_config.layer_window(dict(hf), layer_type), max_model_len)


def _kv_groups(
    hf: Mapping[str, Any],
    settings: PlanSettings,
    stages: list[StagePlan],
    kv_blocks: int | None,
    max_model_len: int,
    batched: int,
) -> tuple[KVGroupPlan, ...]:
    """The KV cache groups and the blocks the engine would give each (``LLMEngine``)."""
    specs = _group_specs(hf, settings)
    blocks: tuple[int | None, ...] = (kv_blocks,) * len(specs)
    if kv_blocks is not None and len(specs) > 1 and settings.num_kv_blocks is None:
        layout = plan_group_blocks(
            specs,
            kv_blocks,
            0,
            [[b * settings.block_size for b in s.kv_group_bytes_per_token] for s in stages],
            block_size=settings.block_size,
            max_model_len=max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=batched,
            decode_tokens=1,
            batches_in_flight=settings.pipeline_parallel_size,
        )
        blocks = layout.num_blocks
    layer_types = hf_config.layer_types(dict(hf))
    layers = [0] * len(specs)
    for layer in range(len(layer_types)):
        layers[_layer_group(hf, specs, layer, settings)] += 1
    return tuple(
        KVGroupPlan(
            sliding_window=spec.sliding_window,
            num_layers=layers[g],
            bytes_per_token=max(s.kv_group_bytes_per_token[g] for s in stages),
            blocks=blocks[g],
        )
        for g, spec in enumerate(specs)
    )


def _with_kv(
    stage: StagePlan, settings: PlanSettings, max_model_len: int, usable: int | None
) -> StagePlan:
    blocks: int | None
    budget = None
    if settings.device == "cuda":
        if usable is not None:
            budget = usable - stage.fixed_bytes
        if settings.num_kv_blocks is not None:
            blocks = settings.num_kv_blocks
        elif budget is not None:
            blocks = max(budget, 0) // stage.kv_block_bytes
        else:
            blocks = None
    else:
        max_useful = settings.max_num_seqs * -(-max_model_len // settings.block_size)
        if settings.num_kv_blocks is not None:
            blocks = settings.num_kv_blocks
        else:
            space = int(settings.cpu_kv_cache_space * GiB) // stage.kv_block_bytes
            blocks = min(space, max_useful)
    return replace(stage, kv_budget_bytes=budget, kv_blocks=blocks)


def memory_problems(plan: MemoryPlan, settings: PlanSettings) -> list[str]:
    """What makes ``plan`` refuse, each naming its numbers."""
    problems = []
    usable = plan.usable_gpu_bytes
    shape_text = f"TP {plan.tensor_parallel_size} x PP {plan.pipeline_parallel_size}"
    if plan.data_parallel_size > 1:
        shape_text = f"DP {plan.data_parallel_size} x {shape_text}"
    weights_fail = False
    if plan.device == "cuda" and usable is not None:
        for stage in plan.stages:
            held = stage.weight_bytes + stage.buffer_bytes + stage.lora_bytes
            if held > usable:
                weights_fail = True
                problems.append(
                    f"weights {gib(stage.weight_bytes)} + buffers {gib(stage.buffer_bytes)}"
                    + (f" + LoRA slots {gib(stage.lora_bytes)}" if stage.lora_bytes else "")
                    + f" per GPU on pipeline stage {stage.pp_rank} ({shape_text}) exceed a "
                    f"GPU's usable {gib(usable)} ({gib(plan.gpu_memory_bytes or 0)} x "
                    f"gpu_memory_utilization {plan.gpu_memory_utilization}); raise "
                    "tensor_parallel_size / pipeline_parallel_size or use GPUs with more memory"
                )
        if settings.num_kv_blocks is not None:
            for stage in plan.stages:
                needed = stage.fixed_bytes + settings.num_kv_blocks * stage.kv_block_bytes
                if needed > usable and not weights_fail:
                    problems.append(
                        f"num_kv_blocks {settings.num_kv_blocks} needs "
                        f"{gib(settings.num_kv_blocks * stage.kv_block_bytes)} of KV cache per "
                        f"GPU on pipeline stage {stage.pp_rank}, but only "
                        f"{gib(max(usable - stage.fixed_bytes, 0))} is left of a GPU's usable "
                        f"{gib(usable)}; lower num_kv_blocks or leave it out"
                    )
    tokens = plan.kv_tokens
    if tokens is not None and tokens < plan.max_model_len and not weights_fail:
        worst = min(plan.stages, key=lambda s: s.kv_blocks or 0)
        where = (
            f"pipeline stage {worst.pp_rank}: {worst.num_layers} layers x "
            f"{worst.kv_bytes_per_token // 1024} KiB per token"
        )
        if worst.kv_budget_bytes is not None and settings.num_kv_blocks is None:
            where += f", {gib(max(worst.kv_budget_bytes, 0))} left for the cache per GPU"
        fix = (
            "lower max_model_len or raise num_kv_blocks"
            if settings.num_kv_blocks is not None
            else "lower max_model_len or raise cpu_kv_cache_space"
            if plan.device == "cpu"
            else "lower max_model_len, or raise tensor_parallel_size / pipeline_parallel_size "
            "or gpu_memory_utilization"
        )
        problems.append(
            f"the KV cache holds {tokens} tokens per replica ({where}), fewer than one "
            f"max_model_len {plan.max_model_len} sequence needs; {fix}"
        )
    return problems


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
