"""vLLM's engine argument names and where each one lands in ``EngineConfig``: the one table
that ``EngineConfig.from_kwargs``, the deployment YAML's ``engine_kwargs`` check
(``cluster.config``) and the KubeRay values schema (``cluster.ops.kuberay``) read.

No torch here, so that a name can be checked where only a config is read.
"""

from __future__ import annotations

import difflib
from typing import Any

from engine.errors import ConfigError

# Engine keyword -> (section of EngineConfig, field name). The keys are vLLM's argument names;
# a few fields are spelled differently (scheduling_policy -> scheduler.policy).
ENGINE_ARGS: dict[str, tuple[str, str]] = {
    "model": ("model", "model"),
    "tokenizer": ("model", "tokenizer"),
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "seed": ("model", "seed"),
    "trust_remote_code": ("model", "trust_remote_code"),
    "quantization": ("model", "quantization"),
    "runner": ("model", "runner"),
    "convert": ("model", "convert"),
    "hf_overrides": ("model", "hf_overrides"),
    "block_size": ("cache", "block_size"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "num_kv_blocks": ("cache", "num_kv_blocks"),
    "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "cpu_kv_cache_space": ("cache", "cpu_kv_cache_space"),
    "swap_space": ("cache", "swap_space"),
    "kv_cache_dtype": ("cache", "cache_dtype"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
    "disable_chunked_mm_input": ("scheduler", "disable_chunked_mm_input"),
    "scheduling_policy": ("scheduler", "policy"),
    "preemption_mode": ("scheduler", "preemption_mode"),
    "max_waiting_requests": ("scheduler", "max_waiting_requests"),
    "max_waiting_tokens": ("scheduler", "max_waiting_tokens"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "pipeline_parallel_size": ("parallel", "pipeline_parallel_size"),
    "distributed_executor_backend": ("parallel", "distributed_executor_backend"),
    "placement_group_strategy": ("parallel", "placement_group_strategy"),
    "pp_layer_partition": ("parallel", "pp_layer_partition"),
    "enable_expert_parallel": ("parallel", "enable_expert_parallel"),
    "data_parallel_size": ("parallel", "data_parallel_size"),
    "device": ("device", "device"),
    "attention_backend": ("kernel", "attention_backend"),
    "enforce_eager": ("kernel", "enforce_eager"),
    "max_logprobs": ("sampling", "max_logprobs"),
    "max_n": ("sampling", "max_n"),
    "max_stop_strings": ("sampling", "max_stop_strings"),
    "max_stop_str_len": ("sampling", "max_stop_str_len"),
    "limit_mm_per_prompt": ("sampling", "limit_mm_per_prompt"),
    "generation_config": ("sampling", "generation_config"),
    "override_generation_config": ("sampling", "override_generation_config"),
    "pooling_type": ("pooler", "pooling_type"),
    "enable_auto_tool_choice": ("frontend", "enable_auto_tool_choice"),
    "tool_call_parser": ("frontend", "tool_call_parser"),
    "reasoning_parser": ("frontend", "reasoning_parser"),
    "chat_template": ("frontend", "chat_template"),
    "default_chat_template_kwargs": ("frontend", "default_chat_template_kwargs"),
    "enable_prompt_tokens_details": ("frontend", "enable_prompt_tokens_details"),
    "enable_lora": ("lora", "enable_lora"),
    "max_loras": ("lora", "max_loras"),
    "max_lora_rank": ("lora", "max_lora_rank"),
    "max_cpu_loras": ("lora", "max_cpu_loras"),
    "speculative_config": ("speculative", "speculative_config"),
    "kv_transfer_config": ("kv_transfer", "kv_transfer_config"),
}

ENGINE_ARG_NAMES: tuple[str, ...] = tuple(ENGINE_ARGS)

# EngineConfig's sections, in its field order.
SECTIONS: tuple[str, ...] = (
    "model", "cache", "scheduler", "parallel", "device", "kernel", "sampling", "pooler",
    "frontend", "lora", "speculative", "kv_transfer",
)  # fmt: skip


# Arguments vLLM declares ``X | None = None`` and fills in itself: null is their default here
# too (YAML written for Ray Serve LLM or dumped from vLLM's EngineArgs carries them).
NULL_IS_DEFAULT = frozenset(
    ("max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching",
     "enable_chunked_prefill")
)  # fmt: skip

# vLLM engine arguments this engine does not take, with where their equivalent lives ("" when
# there is none): checked before the close-match suggestion, which would otherwise point a vLLM
# user at an unrelated name (enable_sleep_mode -> enable_lora).
_VLLM_ONLY_ARGS: dict[str, str] = {
    "enable_sleep_mode": "a model's sleep_config (and sleep_mode.max_awake_models) in the "
    "deployment YAML",
    "served_model_name": "model_loading_config.model_id",
    "pooler_config": "pooling_type",
    "override_pooler_config": "pooling_type",
    "task": "runner and convert",
    "num_gpu_blocks_override": "num_kv_blocks",
    "kv_cache_memory_bytes": "num_kv_blocks or gpu_memory_utilization",
    "revision": "a model_source holding that revision (nothing is fetched)",
    "code_revision": "a model_source holding that revision (nothing is fetched)",
    "tokenizer_revision": "a tokenizer directory holding that revision (nothing is fetched)",
    "download_dir": "model_source (a local directory, builtin:<name> or s3://; nothing is "
    "fetched from the Hub)",
    "load_format": "model_source (safetensors checkpoints are read)",
    "hf_token": "model_source (nothing is fetched from the Hub)",
    "rope_scaling": "hf_overrides",
    "rope_theta": "hf_overrides",
    "compilation_config": "enforce_eager (CUDA graphs for decode steps are the only compilation)",
    "max_seq_len_to_capture": "enforce_eager",
    "async_scheduling": "",
    "enable_log_requests": "",
    "disable_log_requests": "",
    "disable_log_stats": "",
    "tokenizer_mode": "",
    "skip_tokenizer_init": "",
    "cpu_offload_gb": "",
    "disable_custom_all_reduce": "",
    "disable_sliding_window": "",
    "enable_eplb": "",
    "guided_decoding_backend": "",
    "structured_outputs_config": "",
    "mm_processor_kwargs": "",
    "max_parallel_loading_workers": "",
    "model_impl": "",
    "worker_cls": "",
    "scheduler_cls": "",
    "max_num_queued_reqs": "max_waiting_requests",
    "max_num_queued_tokens": "max_waiting_tokens",
    "prefix_caching_hash_algo": "",
    "long_prefill_token_threshold": "",
    "max_num_partial_prefills": "",
    "max_long_partial_prefills": "",
    "scheduler_reserve_full_isl": "",
    "max_num_active_seqs": "max_num_seqs",
    "stream_interval": "",
    "watermark": "",
    "lora_dtype": "",
    "fully_sharded_loras": "",
    "lora_target_modules": "",
}


def check_engine_arg_names(kwargs: dict[str, Any], path: str = "") -> None:
    """Reject unknown engine arguments: a vLLM argument this engine does not take with where
    its equivalent lives, any other with the closest known name."""
    for key in kwargs:
        if not isinstance(key, str):
            yaml_bool = (
                " (YAML reads an unquoted on/off/yes/no key as one)"
                if isinstance(key, bool)
                else ""
            )
            raise ConfigError(
                f"{path}{key}: engine argument names must be strings, got "
                f"{type(key).__name__} {key!r}{yaml_bool}"
            )
        if key in ENGINE_ARGS:
            continue
        if key in _VLLM_ONLY_ARGS:
            pointer = _VLLM_ONLY_ARGS[key]
            use = f"; use {pointer}" if pointer else ""
            raise ConfigError(
                f"{path}{key}: vLLM's engine argument, not supported by this engine{use}"
            )
        close = difflib.get_close_matches(key, ENGINE_ARG_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}{key}: unknown engine argument{hint}")


def group_engine_args(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The arguments as each section's keyword arguments, every section present (empty when
    no argument sets it): ``{"cache": {"block_size": 32}, "scheduler": {"policy": ...}, ...}``.
    Unknown names raise ``ConfigError``."""
    check_engine_arg_names(kwargs)
    groups: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for key, value in kwargs.items():
        if value is None and key in NULL_IS_DEFAULT:
            continue
        section, name = ENGINE_ARGS[key]
        groups[section][name] = value
    return groups
