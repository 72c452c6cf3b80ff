"""The Ray Serve application: one ``LLMServer`` deployment per model (each replica a front and
its head actor; a disaggregated model has two, its prefill and decode pools) and one
``OpenAIIngress`` (``cluster.serving.ingress``) in front that routes by ``model``. This
module builds it and names its parts (the Serve import path ``cluster.serving.serve:build_app``
of the Helm chart).

    build_app("configs/tiny.yaml")  ->  serve.Application  (``serve.run`` or ``cluster deploy``)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ray import serve

from cluster.config import (
    DeploymentConfig,
    ModelDeployment,
    deployment_name,
    load_config,
)
from cluster.serving.ingress import OpenAIIngress
from engine import envs

INGRESS_NAME = "OpenAIIngress"
# Every variable engine/envs.py reads (in the replicas' processes; a test keeps the two in step),
# plus an s3:// model's store endpoint and region, and no other: the API keys' variable, say, and
# the store's credentials must not land in Ray's runtime_env.
_FORWARDED_ENV = ("LLM_CLUSTER_CACHE_DIR", "LLM_CLUSTER_LOG_LEVEL", "LLM_CLUSTER_STEP_TIMEOUT_S",
                  "LLM_CLUSTER_DIST_TIMEOUT_S", "LLM_CLUSTER_LOAD_TIMEOUT_S",
                  "LLM_CLUSTER_STEP_PROFILE", "HF_HUB_OFFLINE",
                  "OMP_NUM_THREADS", "TRITON_INTERPRET", "LLM_CLUSTER_PP_PIPELINING",
                  "LLM_CLUSTER_HEAD_CORE_PROCESS",
                  "LLM_CLUSTER_CPU_KEEP_QUANTIZED",
                  "VLLM_PP_LAYER_PARTITION",
                  *envs.S3_STORE_SETTINGS)  # fmt: skip


def build_app(config: str | os.PathLike[str] | dict[str, Any] | DeploymentConfig) -> Any:
    """The Serve application for a deployment config (validated first; raises ``ConfigError``)."""
    if not isinstance(config, DeploymentConfig):
        config = load_config(config)
    servers: dict[str, Any] = {}
    # Disaggregated models: model id -> (its prefill pool, how long a prompt waits for it,
    # the KV connector between the pools).
    prefill: dict[str, tuple[Any, float, str]] = {}
    # Models whose deployment the name routes to (a disaggregated model's decode pool) may be
    # at zero replicas: model id -> how long a request waits for the first one.
    cold_start: dict[str, float] = {}
    for m in config.models:
        for role, pool in m.pools():
            if role == "prefill" and m.disaggregation is not None:
                timeout_s = m.disaggregation.prefill_timeout_s
                connector = pool.engine_kwargs["kv_transfer_config"]["kv_connector"]
                prefill[m.model_id] = (_server_deployment(pool, role), timeout_s, connector)
                continue
            servers[m.model_id] = _server_deployment(
                pool, role, start_asleep=config.starts_asleep(m.model_id)
            )
            if pool.deployment_config.scales_to_zero:
                cold_start[m.model_id] = pool.deployment_config.cold_start_timeout_s
    hashes = config.api_keys.load_key_hashes() if config.api_keys else []
    # The ingress outlives every model's drain, so aborted streams still reach their clients.
    pools = [pool for m in config.models for _, pool in m.pools()]
    drain_s = max(p.serve_options()["graceful_shutdown_timeout_s"] for p in pools)
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_NAME,
        num_replicas=config.http_options.ingress_replicas,
        max_ongoing_requests=1024,
        graceful_shutdown_timeout_s=drain_s + 5,
        ray_actor_options={"num_cpus": 0, "runtime_env": ingress_runtime_env()},
    )
    lora_models = [m.model_id for m in config.models if m.lora_config is not None]
    # Every ingress replica reaches the same store of /v1/responses results (named by the app).
    store = (config.app_name, dataclasses.asdict(config.responses_store))
    return ingress.bind(
        servers, hashes, config.http_options.max_body_bytes, lora_models, cold_start, store,
        prefill, config.awake_spec(), config.media,
    )  # fmt: skip


def _server_deployment(
    model: ModelDeployment, role: str | None = None, *, start_asleep: bool = False
) -> Any:
    options = model.serve_options()
    bundles = options["placement_group_bundles"]
    # The replica (the front) takes bundle 0; its head actor takes bundle 1 (the device too
    # with TP = PP = 1); worker actors take the rest.
    actor: dict[str, Any] = {"num_cpus": bundles[0].get("CPU", 0), "runtime_env": runtime_env()}
    # Imported here: the front pulls in the engine (torch, transformers); the ingress replica,
    # which imports this module, never runs one.
    from cluster.serving.llm_server import LLMServer

    deployment = serve.deployment(LLMServer).options(
        name=deployment_name(model.model_id, role), ray_actor_options=actor, **options
    )
    drain_timeout_s = model.deployment_config.graceful_shutdown_timeout_s
    head_resources = model.head_resources()
    lora = dataclasses.asdict(model.lora_config) if model.lora_config is not None else None
    sleep = dataclasses.asdict(model.sleep_config) if model.sleep_config is not None else None
    # A prefill pool's replicas name themselves "<model>:prefill" (logs, metrics' model label).
    model_id = model.model_id if role != "prefill" else f"{model.model_id}:prefill"
    return deployment.bind(
        model_id, model.engine_args(), drain_timeout_s, head_resources, lora, sleep, start_asleep
    )


def runtime_env() -> dict[str, Any]:
    """Forward this project's environment settings, and its source tree when it runs from a
    checkout rather than an installed package (replicas must import ``cluster``)."""
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
        )
    return {"env_vars": env} if env else {}


def ingress_runtime_env() -> dict[str, Any]:
    """The ingress replica's environment: :func:`runtime_env` with glibc's malloc arenas capped
    at 2 (``MALLOC_ARENA_MAX``, unless set where the app is built). The ingress relays
    requests and streams and computes nothing; with glibc's default of 8 arenas per core its
    resident memory kept growing under a soak (BENCHMARKS.md, "Soak: the ingress's resident
    memory"), capped it grew half as much."""
    env = runtime_env()
    env.setdefault("env_vars", {})["MALLOC_ARENA_MAX"] = os.environ.get("MALLOC_ARENA_MAX", "2")
    return env


__all__ = ["INGRESS_NAME", "build_app", "deployment_name", "ingress_runtime_env", "runtime_env"]
