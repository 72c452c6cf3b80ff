"""The engine: config, scheduler, block manager, workers, and the LLM / LLMEngine APIs.
It imports no Ray (distributed executors live in ``cluster/``)."""

from __future__ import annotations

import logging

from engine import envs
from engine.config import ConfigError, EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


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
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
