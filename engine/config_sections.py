"""The sections of ``engine.config.EngineConfig``: one small frozen dataclass per concern (what
to load, the KV cache, the scheduler, parallelism, device, kernels, server-wide sampling caps,
pooling, the serving front's parsers and chat template, LoRA), each checking its own fields in
``__post_init__`` under the names of vLLM's arguments, in ``engine.validation``'s one message format
(``max_num_seqs: must be an integer >= 1, got 0``). A section checks only its own fields: what
needs the checkpoint or another section (heads against tensor_parallel_size, a draft against its
target) is ``EngineConfig.from_kwargs``'s. The speculative and KV transfer sections live with
their features (``engine.spec_decode.config``, ``engine.kv_transfer.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from engine.errors import ConfigError
from engine.generation_defaults import GENERATION_FIELDS, check_override
from engine.model_heads import CONVERTS, RUNNERS, Task, family_architecture, resolve_task
from engine.quantization.config import QUANTIZATION_ARGUMENTS
from engine.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive_int,
    check_str,
    is_int,
    require,
)
from llm_kernels.backend import resolve_attention_backend, triton_available
from llm_kernels.kv_quant import KV_CACHE_DTYPES

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelConfig:
    """What to load. ``model`` is a local HF directory, ``builtin:<name>`` or
    ``s3://bucket/prefix`` (``engine.s3_mirror``)."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    trust_remote_code: bool = False
    # vLLM's quantization argument: "fp8" quantizes a float checkpoint at load; a quantized
    # checkpoint takes null or its own method's name (engine.quantization.config).
    quantization: str | None = None
    # What the model serves (vLLM's names; engine.model_heads): auto reads the architecture.
    runner: Literal["auto", "generate", "pooling"] = "auto"
    convert: Literal["auto", "none", "embed", "classify"] = "auto"
    # Fields merged over the checkpoint's config.json (vLLM's hf_overrides), e.g. a causal LM
    # run as a reranker: {"architectures": [...], "classifier_from_token": ["no", "yes"]}.
    hf_overrides: dict[str, Any] | None = None
    # Filled from the checkpoint's config.json by ``EngineConfig.from_kwargs``.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    model_path: str = ""
    # The ids of hf_config's classifier_from_token, read from the tokenizer on the head.
    classifier_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_str(self.model, "model", non_empty=True)
        check_str(self.tokenizer, "tokenizer", non_empty=True, optional=True)
        check_choice(self.dtype, "dtype", ("auto", *_DTYPES))
        check_positive_int(self.max_model_len, "max_model_len", optional=True)
        check_int(self.seed, "seed")
        check_choice(self.quantization, "quantization", (None, *QUANTIZATION_ARGUMENTS))
        check_choice(self.runner, "runner", RUNNERS)
        check_choice(self.convert, "convert", CONVERTS)
        require(
            self.hf_overrides is None or isinstance(self.hf_overrides, dict),
            "hf_overrides",
            f"must be a mapping of config.json fields, got {self.hf_overrides!r}",
        )
        require(
            self.trust_remote_code is False,
            "trust_remote_code",
            f"must be false (remote code is never run), got {self.trust_remote_code!r}",
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        name = self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32"
        return _DTYPES.get(str(name).removeprefix("torch."), torch.float32)

    @property
    def architecture(self) -> str:
        """The decoder family's ``XForCausalLM`` name (``engine.model_heads``)."""
        return family_architecture(self.hf_config)

    @property
    def task(self) -> Task:
        """What the model serves: ``generate``, ``embed`` or ``classify``."""
        return resolve_task(self.hf_config, self.runner, self.convert)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def num_hidden_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        head_dim = self.hf_config.get("head_dim")
        return (
            int(head_dim)
            if head_dim
            else int(self.hf_config["hidden_size"]) // self.num_attention_heads
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space: float = 4.0
    swap_space: float = 4.0
    # vLLM's kv_cache_dtype: "auto" (the model's dtype) or "fp8"/"fp8_e4m3" (llm_kernels.kv_quant).
    cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"

    def __post_init__(self) -> None:
        check_choice(self.block_size, "block_size", (8, 16, 32, 64, 128))
        check_bool(self.enable_prefix_caching, "enable_prefix_caching")
        check_choice(self.cache_dtype, "kv_cache_dtype", KV_CACHE_DTYPES)
        check_positive_int(self.num_kv_blocks, "num_kv_blocks", optional=True)
        check_number(self.gpu_memory_utilization, "gpu_memory_utilization", gt=0, le=1)
        check_number(self.cpu_kv_cache_space, "cpu_kv_cache_space", gt=0, note="GiB")
        check_number(self.swap_space, "swap_space", ge=0, note="GiB")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # A prefill chunk never ends inside an image's placeholder tokens (it stops before the
    # image); forced on for a model whose image tokens attend each other both ways (Gemma 3).
    disable_chunked_mm_input: bool = False
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # Admission control: a request is refused (EngineOverloadedError -> 503 + Retry-After)
    # when the samples not yet running, or the tokens they still have to compute, would exceed
    # these; an empty queue always admits one request. None: unbounded.
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None

    def __post_init__(self) -> None:
        check_positive_int(self.max_num_seqs, "max_num_seqs")
        check_bool(self.enable_chunked_prefill, "enable_chunked_prefill")
        check_bool(self.disable_chunked_mm_input, "disable_chunked_mm_input")
        check_positive_int(self.max_waiting_requests, "max_waiting_requests", optional=True)
        check_positive_int(self.max_waiting_tokens, "max_waiting_tokens", optional=True)
        check_positive_int(self.max_num_batched_tokens, "max_num_batched_tokens")
        check_positive_int(self.max_model_len, "max_model_len")
        check_choice(self.policy, "scheduling_policy", ("fcfs", "priority"))
        check_choice(self.preemption_mode, "preemption_mode", ("recompute", "swap"))
        if not self.enable_chunked_prefill:
            # Without chunking a whole prompt must fit in one step's budget.
            check_int(
                self.max_num_batched_tokens,
                "max_num_batched_tokens",
                ge=self.max_model_len,
                note="max_model_len, as enable_chunked_prefill is false",
            )


def check_batch_budget(scheduler_kwargs: dict[str, object]) -> None:
    """vLLM's rule where both are given: a step's token budget holds a token of every sequence
    it may run (``max_num_batched_tokens >= max_num_seqs``)."""
    seqs = scheduler_kwargs.get("max_num_seqs")
    budget = scheduler_kwargs.get("max_num_batched_tokens")
    if is_int(seqs) and is_int(budget):
        check_int(budget, "max_num_batched_tokens", ge=seqs, note="max_num_seqs")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: Literal["auto", "uni", "ray"] = "auto"
    placement_group_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    # Decoder layers per pipeline stage, e.g. (7, 5); from_kwargs fills it in from
    # VLLM_PP_LAYER_PARTITION when not given. None: the balanced default, which gives the last
    # stage (LM head, sampling) fewer layers (engine.pp_partition).
    pp_layer_partition: tuple[int, ...] | None = None
    enable_expert_parallel: bool = False  # MoE: whole experts per EP rank (parallel.moe)
    # Data-parallel attention (vLLM's name): this many engine cores, each with its own
    # scheduler, KV cache and requests and a TP group of its own, stepping together; MoE
    # experts split over all data_parallel_size x tensor_parallel_size ranks (docs/moe.md).
    data_parallel_size: int = 1
    # Set per rank with dataclasses.replace by the executor that spawns the workers.
    rank: int = 0

    def __post_init__(self) -> None:
        check_positive_int(self.tensor_parallel_size, "tensor_parallel_size")
        check_positive_int(self.pipeline_parallel_size, "pipeline_parallel_size")
        check_positive_int(self.data_parallel_size, "data_parallel_size")
        check_choice(
            self.distributed_executor_backend,
            "distributed_executor_backend",
            ("auto", "uni", "ray"),
        )
        check_choice(
            self.placement_group_strategy,
            "placement_group_strategy",
            ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"),
        )
        check_bool(self.enable_expert_parallel, "enable_expert_parallel")
        # 'uni' is the in-process executor (vLLM's meaning too): one worker, no process group,
        # so any parallel size would be dropped without a word.
        require(
            self.distributed_executor_backend != "uni" or self.world_size == 1,
            "distributed_executor_backend",
            f"'uni' runs one worker in the head's process; tensor_parallel_size "
            f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size}"
            f" x data_parallel_size {self.data_parallel_size} = {self.world_size} workers "
            "needs 'ray' (or 'auto')",
        )
        if self.data_parallel_size > 1:
            require(
                self.pipeline_parallel_size == 1,
                "data_parallel_size",
                f"does not combine with pipeline parallelism (pipeline_parallel_size "
                f"{self.pipeline_parallel_size}); got {self.data_parallel_size}",
            )
            require(
                self.enable_expert_parallel,
                "data_parallel_size",
                f"> 1 needs enable_expert_parallel: true (its ranks share one expert-parallel "
                f"group); got {self.data_parallel_size}. A model without experts scales by "
                f"replicas (num_replicas)",
            )
        if self.pp_layer_partition is not None:
            require(
                isinstance(self.pp_layer_partition, (list, tuple)),
                "pp_layer_partition",
                f"must list {self.pipeline_parallel_size} positive layer counts (one per "
                f"pipeline stage), got {self.pp_layer_partition!r}",
            )
            # YAML and JSON give lists; keep the frozen config hashable and immutable.
            object.__setattr__(self, "pp_layer_partition", tuple(self.pp_layer_partition))
            require(
                len(self.pp_layer_partition) == self.pipeline_parallel_size
                and all(isinstance(n, int) and n >= 1 for n in self.pp_layer_partition),
                "pp_layer_partition",
                f"must list {self.pipeline_parallel_size} positive layer counts (one per "
                f"pipeline stage), got {list(self.pp_layer_partition)}",
            )
        check_int(self.rank, "rank", ge=0, lt=self.world_size, note="world_size")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def ep_size(self) -> int:
        """Ranks the experts are split over under ``enable_expert_parallel``."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank (engine core) this worker rank serves."""
        return self.rank // (self.tensor_parallel_size * self.pipeline_parallel_size)

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        return "ray" if self.world_size > 1 else "uni"


@dataclass(frozen=True)
class DeviceConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self) -> None:
        check_choice(self.device, "device", ("auto", "cpu", "cuda"))

    @property
    def device_type(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels run the model and whether decode steps may replay CUDA graphs.

    ``attention_backend``: ``auto`` (Triton on CUDA; on CPU ``cpu`` where its kernel builds,
    else ``torch``), ``triton``, ``cpu`` (the torch kernels with decode attention in the native
    AVX-512/AVX2 kernel, ``llm_kernels.cpu_decode``, and RMSNorm and rotary in
    ``llm_kernels.cpu_layer_kernels``) or ``torch``; it selects the attention,
    cache and fused pointwise kernels together.
    ``enforce_eager``: never capture CUDA graphs (they are only used on CUDA with Triton).
    """

    attention_backend: Literal["auto", "triton", "cpu", "torch"] = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        check_choice(
            self.attention_backend, "attention_backend", ("auto", "triton", "cpu", "torch")
        )
        check_bool(self.enforce_eager, "enforce_eager")
        if self.attention_backend == "triton":
            require(
                triton_available(),
                "attention_backend",
                "'triton' needs the triton package, which is not installed "
                "(pip install 'llm-cluster[triton]'), or use 'torch'",
            )

    def resolved_backend(self, device_type: str) -> str:
        """The backend that runs on ``device_type``: ``auto`` means Triton on CUDA when the
        triton package is installed; on CPU the native decode kernel where it builds; torch
        otherwise. May build that kernel (~20 s once per machine), so it is called where the
        model loads, not where configs are made."""
        return resolve_attention_backend(self.attention_backend, device_type)


@dataclass(frozen=True)
class SamplingConfig:
    """Server-wide caps checked before a request is enqueued (vLLM: ``max_logprobs`` 20).
    ``max_stop_strings`` / ``max_stop_str_len`` bound ``stop``: every stop string is matched
    against the text after every token, so their number and length are a per-step cost."""

    max_logprobs: int = 20
    max_n: int = 128
    max_stop_strings: int = 16
    max_stop_str_len: int = 256
    # vLLM's: the most items of each modality one prompt may hold ({"image": 4}); a modality
    # left out is bounded only by max_model_len.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    # vLLM's: where unset request fields take their defaults (engine.generation_defaults):
    # "auto" the model's generation_config.json, "vllm" none, or a directory holding one;
    # override_generation_config's values (HF names) over those.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(
            isinstance(self.generation_config, str) and self.generation_config != "",
            "generation_config",
            f"must be 'auto', 'vllm' or a directory, got {self.generation_config!r}",
        )
        override = self.override_generation_config
        require(
            isinstance(override, dict),
            "override_generation_config",
            f"must map sampling fields to values, got {override!r}",
        )
        for key in override:
            require(
                key in GENERATION_FIELDS,
                f"override_generation_config.{key}",
                f"is not one of {', '.join(GENERATION_FIELDS)}",
            )
        check_override(override)
        check_int(self.max_logprobs, "max_logprobs", ge=0)
        check_positive_int(self.max_n, "max_n")
        check_positive_int(self.max_stop_strings, "max_stop_strings")
        check_positive_int(self.max_stop_str_len, "max_stop_str_len")
        limits = self.limit_mm_per_prompt
        require(
            isinstance(limits, dict) and all(k in ("image",) for k in limits),
            "limit_mm_per_prompt",
            f"must map a modality ('image') to a count, got {limits!r}",
        )
        for key, value in limits.items():
            check_int(value, f"limit_mm_per_prompt.{key}", ge=0)


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding (pooling) request turns the prompt's final hidden states into one
    vector (vLLM's ``pooler_config.pooling_type``; ``LAST`` / ``MEAN`` accepted as vLLM spells
    them): ``last`` takes the last prompt position's, ``mean`` averages every position's."""

    # "any_case": the chart's values schema takes it in any case too (cluster.ops.kuberay).
    pooling_type: Literal["last", "mean"] = field(default="last", metadata={"any_case": True})

    def __post_init__(self) -> None:
        value = self.pooling_type
        require(
            isinstance(value, str) and value.lower() in ("last", "mean"),
            "pooling_type",
            f"must be one of 'last', 'mean' (in any case), got {value!r}",
        )
        object.__setattr__(self, "pooling_type", value.lower())


# gpt-oss's harmony format has one parser of each kind (vLLM's names), which read it together
# (cluster.api.harmony): naming either names both, and they are the default for gpt-oss.
HARMONY_PARSERS = {"reasoning_parser": "openai_gptoss", "tool_call_parser": "openai"}


@dataclass(frozen=True)
class FrontendConfig:
    """Settings of the serving front, not of the engine core: vLLM's server arguments for tool
    calling, accepted among the engine arguments so that a deployment YAML carries them in
    ``engine_kwargs`` as Ray Serve LLM's does. ``tool_call_parser`` names how the front reads
    tool calls out of the model's text (``cluster.api.tool_parsers``, which checks the name);
    ``enable_auto_tool_choice`` lets requests use ``tool_choice: "auto"``. ``reasoning_parser``
    (vLLM's server option) splits a reasoning model's think block out of chat answers
    (``cluster.api.reasoning_parsers``, which checks the name). gpt-oss's ``openai_gptoss`` and
    ``openai`` come as a pair (naming one names the other) and are ``GptOssForCausalLM``'s
    default. ``chat_template`` replaces the tokenizer's (vLLM's ``--chat-template``: a Jinja
    file's path, held here as its text, or the template itself), and
    ``default_chat_template_kwargs`` are template variables a chat request's own
    ``chat_template_kwargs`` override (vLLM's server option of that name).
    ``enable_prompt_tokens_details`` adds ``prompt_tokens_details.cached_tokens`` (the prompt's
    tokens read from the prefix cache) to chat and completions usage, as vLLM's does."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    default_chat_template_kwargs: dict[str, Any] | None = None
    enable_prompt_tokens_details: bool = False

    def __post_init__(self) -> None:
        check_bool(self.enable_auto_tool_choice, "enable_auto_tool_choice")
        check_bool(self.enable_prompt_tokens_details, "enable_prompt_tokens_details")
        check_str(self.tool_call_parser, "tool_call_parser", note="a parser name", optional=True)
        check_str(self.reasoning_parser, "reasoning_parser", note="a parser name", optional=True)
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", load_chat_template(self.chat_template))
        defaults = self.default_chat_template_kwargs
        require(
            defaults is None
            or (isinstance(defaults, dict) and all(isinstance(k, str) for k in defaults)),
            "default_chat_template_kwargs",
            f"must be a mapping of template variable names to values, got {defaults!r}",
        )
        for key in ("chat_template", "tokenize"):  # as a request's chat_template_kwargs
            require(
                key not in (defaults or {}),
                f"default_chat_template_kwargs.{key}",
                "is not a template variable (set chat_template among the engine arguments)",
            )
        self._pair_harmony_parsers()

    def check_auto_tool_choice(self) -> None:
        """With the model's defaults applied (a checkpoint may name the parser: gpt-oss)."""
        require(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "enable_auto_tool_choice",
            "needs tool_call_parser (how to read tool calls out of the model's text)",
        )

    def _pair_harmony_parsers(self) -> None:
        named = [k for k, v in HARMONY_PARSERS.items() if getattr(self, k) == v]
        if not named:
            return
        for key, value in HARMONY_PARSERS.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
            require(
                getattr(self, key) == value,
                key,
                f"must be {value!r} (or unset) with {named[0]} {HARMONY_PARSERS[named[0]]!r}: "
                f"both read gpt-oss's harmony format, got {getattr(self, key)!r}",
            )


def load_chat_template(value: object) -> str:
    """``chat_template`` as vLLM's ``--chat-template`` reads it: text holding ``{``, ``}`` or a
    line break is the template itself; anything else is the path of a file holding it."""
    check_str(value, "chat_template", non_empty=True, note="a Jinja template or its file's path")
    value = str(value)
    if any(c in value for c in "{}\n"):
        return value
    try:
        text = Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"chat_template: {value!r} is not a template (no '{{', '}}' or line break) and "
            f"cannot be read as a file: {reason}"
        ) from None
    require(bool(text.strip()), "chat_template", f"the file {value!r} is empty")
    return text


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's arguments): ``max_loras`` adapters resident per step in fixed
    device slots, ranks up to ``max_lora_rank``, ``max_cpu_loras`` checked adapters cached on
    the head (default: ``max_loras``)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_bool(self.enable_lora, "enable_lora")
        check_positive_int(self.max_loras, "max_loras")
        check_positive_int(self.max_lora_rank, "max_lora_rank")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        check_int(self.max_cpu_loras, "max_cpu_loras", ge=self.max_loras, note="max_loras")
