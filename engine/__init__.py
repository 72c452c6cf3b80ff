"""The engine: one model's scheduler, KV cache and workers, and the ``LLM`` / ``LLMEngine``
APIs. It imports no Ray (distributed executors live in ``cluster/``).

    engine/            config (EngineConfig, engine args, HF config), SamplingParams,
                       PoolingParams, outputs, errors, LoRA, the PP layer partition,
                       s3:// checkpoints (s3_store, s3_mirror)
      client/          LLM, AsyncLLMEngine, the core's loop and process, core_messages
      core/            LLMEngine, scheduler, block manager, requests, input/output processing
      worker/          Executor, step_messages, Worker, ModelRunner, CacheEngine, sampler, KV sizing
      models/          the model families            quantization/   checkpoint formats
      spec_decode/     speculative decoding          builtin/        random built-in models
      multimodal/      images: chat parts, preprocessing, the per-image record sent to workers

``EngineConfig``, ``LLM`` and ``LLMEngine`` are imported on first use: they pull in torch and
transformers (tokenizer), which a worker process, importing ``engine.worker.worker`` through this
package, needs only in part, and the ingress and the CLI, which only route requests, not at all.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from engine import envs
from engine.errors import (
    ConfigError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestAbortedError,
)
from engine.lora_request import LoRARequest
from engine.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.client.llm import LLM
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

_LAZY = {
    "EngineConfig": "engine.config",
    "LLM": "engine.client.llm",
    "LLMEngine": "engine.core.llm_engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def _init_logging() -> None:
    logger = logging.getLogger("llm_cluster")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(envs.log_level())
        logger.propagate = False


_init_logging()

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "LLMEngine",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestAbortedError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
