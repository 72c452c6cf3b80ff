"""The engine's one frozen root config, ``EngineConfig``, built by ``from_kwargs`` from keyword
arguments with vLLM's names (``engine.engine_args``'s table): it reads the checkpoint and runs
the checks that span sections before anything loads. Each section is a small frozen dataclass
that checks its own fields (``engine.config_sections``), in ``engine.validation``'s format.

    EngineConfig
    ├── model:     ModelConfig      (what to load, dtype, max_model_len)
    ├── cache:     CacheConfig      (block_size, kv_cache_dtype, prefix caching, KV pool, swap)
    ├── scheduler: SchedulerConfig  (token budget, sequence cap, chunking, policy, preemption)
    ├── parallel:  ParallelConfig   (tensor_parallel_size, pipeline_parallel_size, EP)
    ├── device:    DeviceConfig     (cpu | cuda | auto)
    ├── kernel:    KernelConfig     (attention_backend, enforce_eager)
    ├── sampling:  SamplingConfig   (server-wide request caps: max_n, max_logprobs)
    ├── pooler:    PoolerConfig     (pooling_type of embedding requests: last | mean)
    ├── frontend:  FrontendConfig   (tool and reasoning parsers, chat template and its defaults)
    ├── lora:      LoRAConfig       (enable_lora, max_loras, max_lora_rank, max_cpu_loras)
    ├── speculative: SpeculativeArgs (speculative_config; engine.spec_decode.config)
    └── kv_transfer: KVTransferArgs  (kv_transfer_config; engine.kv_transfer.config)
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.config_sections import (
    HARMONY_PARSERS,
    CacheConfig,
    DeviceConfig,
    FrontendConfig,
    KernelConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SamplingConfig,
    SchedulerConfig,
    check_batch_budget,
)
from engine.core.kv_cache_groups import group_window, kv_cache_group_specs
from engine.engine_args import ENGINE_ARG_NAMES as ENGINE_ARG_NAMES
from engine.engine_args import ENGINE_ARGS, group_engine_args
from engine.engine_args import check_engine_arg_names as check_engine_arg_names
from engine.errors import ConfigError
from engine.hf_config import DEEPSEEK_ARCHITECTURES, GPT_OSS, layer_types, layer_window
from engine.kv_transfer.config import KVTransferArgs, check_kv_transfer_support
from engine.kv_transfer.store import store_namespace
from engine.model_checks import (
    check_kernel_device,
    check_parallel_shape,
    check_whole_images,
    derive_max_model_len,
    with_checkpoint,
)
from engine.pp_partition import requested_partition
from engine.quantization.config import keeps_mxfp4_experts
from engine.spec_decode.config import (
    SpeculativeArgs,
    SpeculativeConfig,
    check_speculative_support,
)
from engine.validation import require

# The name -> (section, field) table under its former name, which cluster.ops.kuberay reads.
_ENGINE_ARGS = ENGINE_ARGS


@dataclass(frozen=True)
class EngineConfig:
    """The root config. Every section is validated in ``__post_init__`` under the names of
    vLLM's arguments (a deployment YAML prefixes its key path to them); per-rank copies use
    ``dataclasses.replace``. The number of KV blocks measured at startup is runtime state (see
    ``Worker.determine_num_available_blocks``), not a config field; ``num_kv_blocks`` is only
    the optional explicit override."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    pooler: PoolerConfig = field(default_factory=PoolerConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeArgs = field(default_factory=SpeculativeArgs)
    kv_transfer: KVTransferArgs = field(default_factory=KVTransferArgs)
    # speculative_config method draft_model: the draft's ModelConfig, read and checked with the
    # target's (vLLM keeps it as speculative_config.draft_model_config); None otherwise.
    draft_model: ModelConfig | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM-named engine arguments; unknown keys raise ``ConfigError``."""
        groups = group_engine_args(kwargs)
        if "model" not in kwargs:
            raise ConfigError(
                "model: is required (a local HF directory, builtin:<name> or s3://bucket/prefix)"
            )
        model = ModelConfig(**groups["model"])
        model = with_checkpoint(model)
        parallel = ParallelConfig(**groups["parallel"])
        check_parallel_shape(model, parallel)
        # Read here, on the head, so that every worker builds the same stages.
        partition = requested_partition(
            parallel.pp_layer_partition, parallel.pipeline_parallel_size, model.num_hidden_layers
        )
        parallel = dataclasses.replace(parallel, pp_layer_partition=partition)
        max_model_len = derive_max_model_len(model)
        model = dataclasses.replace(model, max_model_len=max_model_len)
        sched_kwargs = groups["scheduler"]
        check_batch_budget(sched_kwargs)
        chunked = sched_kwargs.get("enable_chunked_prefill", True)
        if "max_num_batched_tokens" not in sched_kwargs:
            sched_kwargs["max_num_batched_tokens"] = 2048 if chunked else max(2048, max_model_len)
        check_whole_images(model.hf_config, sched_kwargs)
        scheduler = SchedulerConfig(max_model_len=max_model_len, **sched_kwargs)
        device = DeviceConfig(**groups["device"])
        kernel = KernelConfig(**groups["kernel"])
        check_kernel_device(kernel, device)
        require(
            parallel.data_parallel_size == 1
            # (resolving the backend may build the CPU kernel: only for an MXFP4 checkpoint)
            or not keeps_mxfp4_experts(model.hf_config, "triton")
            or not keeps_mxfp4_experts(
                model.hf_config, kernel.resolved_backend(device.device_type)
            ),
            "data_parallel_size",
            f"> 1 does not cover MXFP4 experts kept quantized on the triton kernels (they have "
            f"no token exchange); got {parallel.data_parallel_size}",
        )
        speculative = SpeculativeArgs(**groups["speculative"])
        check_speculative_support(
            speculative.speculative_config,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            tensor_parallel_size=parallel.tensor_parallel_size,
            max_model_len=max_model_len,
        )
        spec = speculative.speculative_config
        draft_model = None
        if spec is not None and spec.method == "draft_model":
            require(
                parallel.data_parallel_size == 1,
                "speculative_config",
                f"method draft_model does not combine with data_parallel_size "
                f"{parallel.data_parallel_size} (only the cores with tokens would run the "
                f"draft); use method ngram",
            )
            draft_model = _draft_model_config(spec, model, parallel)  # before anything is placed
        lora = LoRAConfig(**groups["lora"])
        require(
            not lora.enable_lora or model.architecture not in DEEPSEEK_ARCHITECTURES,
            "enable_lora",
            f"LoRA adapters are not supported for {model.architecture} (multi-head latent "
            "attention has no q/k/v projections to adapt); set enable_lora to false",
        )
        frontend = FrontendConfig(**_frontend_defaults(model, groups["frontend"]))
        frontend.check_auto_tool_choice()
        require(
            frontend.chat_template is None or model.architecture != GPT_OSS,
            "chat_template",
            "gpt-oss's chats are rendered in its harmony format, not by a chat template; "
            "leave chat_template unset",
        )
        cache = CacheConfig(**groups["cache"])
        kv_transfer = KVTransferArgs(**groups["kv_transfer"])
        check_kv_transfer_support(
            kv_transfer.kv_transfer_config,
            model.hf_config,
            max_model_len,
            cache.enable_prefix_caching,
            parallel.data_parallel_size,
        )
        config = cls(
            model=model,
            cache=cache,
            scheduler=scheduler,
            parallel=parallel,
            device=device,
            kernel=kernel,
            sampling=SamplingConfig(**groups["sampling"]),
            pooler=PoolerConfig(**groups["pooler"]),
            frontend=frontend,
            lora=lora,
            speculative=speculative,
            kv_transfer=kv_transfer,
            draft_model=draft_model,
        )
        kv = kv_transfer.kv_transfer_config
        if kv is None:
            return config
        engine_id = f"{uuid.uuid4().hex[:16]}"
        transfer = KVTransferArgs(kv, store_namespace(config), engine_id)
        return dataclasses.replace(config, kv_transfer=transfer)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len


def _frontend_defaults(model: ModelConfig, frontend: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's harmony parsers unless the engine arguments name a parser (null included)."""
    if model.architecture != GPT_OSS or frontend.keys() & HARMONY_PARSERS.keys():
        return frontend
    return {**HARMONY_PARSERS, **frontend}


def check_engine_arg_ranges(kwargs: dict[str, Any]) -> None:
    """Names, types and ranges of engine arguments without reading any checkpoint: each
    sub-config is built alone. ``EngineConfig.from_kwargs`` adds the model-shape checks."""
    groups = group_engine_args(kwargs)
    ModelConfig(**{"model": "unchecked", **groups["model"]})
    CacheConfig(**groups["cache"])
    sched = dict(groups["scheduler"])
    check_batch_budget(sched)
    sched["max_model_len"] = kwargs.get("max_model_len") or 2048
    if not sched.get("enable_chunked_prefill", True):
        sched.setdefault("max_num_batched_tokens", sched["max_model_len"])
    SchedulerConfig(**sched)
    ParallelConfig(**groups["parallel"])
    DeviceConfig(**groups["device"])
    KernelConfig(**groups["kernel"])
    SamplingConfig(**groups["sampling"])
    PoolerConfig(**groups["pooler"])
    FrontendConfig(**groups["frontend"])
    LoRAConfig(**groups["lora"])
    KVTransferArgs(**groups["kv_transfer"])
    check_speculative_support(
        SpeculativeArgs(**groups["speculative"]).speculative_config,
        pipeline_parallel_size=groups["parallel"].get("pipeline_parallel_size", 1),
        tensor_parallel_size=groups["parallel"].get("tensor_parallel_size", 1),
        max_model_len=kwargs.get("max_model_len"),
    )


def _draft_model_config(
    spec: SpeculativeConfig, target: ModelConfig, parallel: ParallelConfig
) -> ModelConfig:
    """The draft's ModelConfig (the target's dtype and max_model_len), or ConfigError naming
    ``speculative_config.model`` and what does not match. The draft is sharded like the target
    (same tensor-parallel ranks), so its heads and MLP must divide by ``tensor_parallel_size``;
    its vocabulary must equal the target's, since its token ids are verified against the
    target's rows as they are."""
    key = "speculative_config.model"
    dtype = str(target.torch_dtype).removeprefix("torch.")
    try:
        draft = with_checkpoint(ModelConfig(model=str(spec.model), dtype=dtype))
    except (ConfigError, OSError, ValueError) as exc:
        raise ConfigError(f"{key}: draft {spec.model!r} cannot be served: {exc}") from exc
    draft = dataclasses.replace(draft, max_model_len=target.max_model_len)
    require(
        draft.vocab_size == target.vocab_size,
        key,
        f"the draft {spec.model!r} has vocab_size {draft.vocab_size}, the target "
        f"{target.model!r} has {target.vocab_size}: a draft needs the target's vocabulary",
    )
    require(
        draft.hf_config.get("quantization_config") is None,
        key,
        f"the draft {spec.model!r} is a quantized checkpoint: only float drafts are supported",
    )
    try:
        check_parallel_shape(draft, parallel)
    except ConfigError as exc:
        raise ConfigError(
            f"{key}: the draft {spec.model!r} is sharded like the target and cannot be: {exc}"
        ) from exc
    _check_draft_windows(spec, target, draft)
    return draft


def _check_draft_windows(spec: SpeculativeConfig, target: ModelConfig, draft: ModelConfig) -> None:
    """The draft's layers keep their KV in the target's KV cache groups (the group of the same
    sliding window, ``engine.core.kv_cache_groups``), so each draft window must be one of the
    target's (a window of max_model_len or more counts as full attention)."""
    max_model_len = target.max_model_len
    groups = [s.sliding_window for s in kv_cache_group_specs(target.hf_config, max_model_len)]
    for layer_type in dict.fromkeys(layer_types(draft.hf_config)):
        window = group_window(layer_window(draft.hf_config, layer_type), max_model_len)
        require(
            window in groups,
            "speculative_config.model",
            f"the draft {spec.model!r} has {layer_type} layers with {_window(window)}, which "
            f"the target {target.model!r} keeps no KV cache for (the target has "
            f"{', '.join(_window(w) for w in groups)} at max_model_len {max_model_len}); a "
            f"draft's sliding windows must be the target's",
        )


def _window(window: int | None) -> str:
    return "full attention" if window is None else f"sliding_window {window}"
