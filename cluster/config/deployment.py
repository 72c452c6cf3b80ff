"""The deployment YAML's typed tree (frozen dataclasses in the shape of Ray Serve LLM's
``LLMConfig``): the models, each with its engine arguments and its features (LoRA, sleep,
prefill/decode disaggregation), the application's sections, and ``load_config``, which builds
the tree strictly (``cluster.config.strict_yaml``) and checks all of it before anything is
deployed. Serve's per-model options are ``cluster.config.serve_sections``; the front's
(HTTP, gRPC, API keys, responses store) ``cluster.config.app_sections``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.api.media import MediaSettings
from cluster.api.reasoning_parsers import REASONING_PARSERS
from cluster.api.tool_parsers import TOOL_PARSERS
from cluster.config.app_sections import (
    APIKeysConfig,
    GRPCOptions,
    HTTPOptions,
    ResponsesStoreConfig,
)
from cluster.config.ray_names import (
    check_accelerator_type,
    check_app_name,
    check_model_id,
)
from cluster.config.serve_sections import PlacementGroupConfig, ServeDeploymentConfig
from cluster.config.strict_yaml import build_dataclass, load_yaml_file
from engine.errors import ConfigError
from engine.s3_store import is_s3_uri
from engine.validation import check_int, check_number, check_str, require

# Where a replica's head actor sits in its placement group (the front, the replica, is 0).
HEAD_BUNDLE_INDEX = 1


# A disaggregated model's KV transfer unless its engine_kwargs name one: the node's store.
_DEFAULT_CONNECTOR = {"kv_connector": "SharedStorageConnector"}


@dataclass(frozen=True)
class BucketMirrorConfig:
    """Ray Serve LLM's mirror form of ``model_source``: ``{bucket_uri: s3://bucket/prefix}``."""

    bucket_uri: str


@dataclass(frozen=True)
class ModelLoadingConfig:
    model_id: str  # the name clients put in the request's ``model`` field
    # A local HF directory, builtin:<name>, or s3://bucket/prefix (as a string or as
    # {bucket_uri: ...}): a copy of it on each node (engine.s3_mirror); nothing else is fetched.
    model_source: str | BucketMirrorConfig

    @property
    def source(self) -> str:
        """The engine's ``model``: the string, or the mirror's bucket URI."""
        if isinstance(self.model_source, BucketMirrorConfig):
            return self.model_source.bucket_uri
        return self.model_source

    def check(self, path: str) -> None:
        if isinstance(self.model_source, BucketMirrorConfig):
            uri = self.model_source.bucket_uri
            require(
                is_s3_uri(uri),
                f"{path}.model_source.bucket_uri",
                f"must be an s3://bucket/prefix URI (the only store served), got {uri!r}",
            )


@dataclass(frozen=True)
class LoraConfig:
    """Ray Serve LLM's ``lora_config``: LoRA adapters of this model, served as ``<model>:<name>``
    and loaded on first use from ``<dynamic_lora_loading_path>/<name>`` (a PEFT directory on a
    path every replica's node can read); each replica keeps at most
    ``max_num_adapters_per_replica`` (least recently used unloaded first), and Serve's model
    multiplexing routes an adapter's requests to replicas that hold it. Adapters are read, never
    downloaded: Ray's ``download_timeout_s`` (> 0, or null) and ``max_download_tries`` are
    checked and have no effect."""

    dynamic_lora_loading_path: str
    max_num_adapters_per_replica: int = 16
    download_timeout_s: float | None = 30.0
    max_download_tries: int = 3

    def check(self, path: str) -> None:
        where, key = self.dynamic_lora_loading_path, f"{path}.dynamic_lora_loading_path"
        check_str(where, key, non_empty=True, note="a directory")
        require("://" not in where, key, f"must be a local or mounted directory, got {where!r}")
        check_int(self.max_num_adapters_per_replica, f"{path}.max_num_adapters_per_replica", ge=1)
        check_number(self.download_timeout_s, f"{path}.download_timeout_s", gt=0, optional=True)
        check_int(self.max_download_tries, f"{path}.max_download_tries", ge=1)


@dataclass(frozen=True)
class SleepConfig:
    """``sleep_config``: the model's replicas sleep (vLLM's sleep mode, ``level`` 1: KV cache
    freed, weights kept in host memory; 2: both freed) after ``sleep_after_idle_s`` without a
    request (never, if unset: only the admin routes and ``cluster sleep`` put it to sleep),
    instead of scaling to zero; a request to a sleeping replica waits at most
    ``wake_timeout_s`` for it to wake."""

    sleep_after_idle_s: float | None = None
    level: int = 1
    wake_timeout_s: float = 300.0

    def check(self, path: str) -> None:
        if self.sleep_after_idle_s is not None:
            check_number(self.sleep_after_idle_s, f"{path}.sleep_after_idle_s", gt=0)
        require(self.level in (1, 2), f"{path}.level", f"must be 1 or 2, got {self.level!r}")
        check_number(self.wake_timeout_s, f"{path}.wake_timeout_s", gt=0)


@dataclass(frozen=True)
class PoolConfig:
    """One side of a disaggregated model: engine arguments over the model's, Serve options."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    deployment_config: ServeDeploymentConfig = field(default_factory=ServeDeploymentConfig)


# What must be equal on both sides for the decode pool to read the prefill pool's blocks.
# (The TP size may differ: the store keeps a file per KV head, engine.kv_transfer.store.)
_SAME_KV_LAYOUT = ("pipeline_parallel_size", "pp_layer_partition", "dtype", "block_size",
                   "kv_cache_dtype", "device", "attention_backend", "quantization",
                   "hf_overrides", "data_parallel_size")  # fmt: skip


@dataclass(frozen=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation (``docs/kv_transfer.md``): the ``prefill`` pool computes
    each prompt's KV and saves it to the node's KV store (``kv_producer``); the ``decode`` pool,
    which the model's name routes to, loads it and generates (``kv_consumer``). With
    ``kv_connector: NixlConnector`` the prefill holds the blocks and the decode pool reads them
    from its KV cache with NIXL (any node). The ingress
    sends the prompt to prefill first and waits at most ``prefill_timeout_s``; after a timeout
    or a failed prefill the decode pool computes whatever it does not find."""

    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    prefill_timeout_s: float = 30.0

    def check(self, path: str, model: ModelDeployment) -> None:
        check_number(self.prefill_timeout_s, f"{path}.prefill_timeout_s", gt=0)
        for role in ("prefill", "decode"):
            pool: PoolConfig = getattr(self, role)
            pool.deployment_config.check(f"{path}.{role}.deployment_config")
            role_kwargs = model.engine_kwargs | pool.engine_kwargs
            transfer = role_kwargs.get("kv_transfer_config")
            require(transfer is None or isinstance(transfer, dict),
                    f"{path}.{role}.engine_kwargs.kv_transfer_config",
                    f"must be a mapping (kv_connector, ...), got {transfer!r}")  # fmt: skip
            given = (transfer or {}).get("kv_role")
            require(
                given in (None, _KV_ROLES[role]),
                f"{path}.{role}.engine_kwargs.kv_transfer_config.kv_role",
                f"is {_KV_ROLES[role]!r} in the {role} pool (set by disaggregation), got {given!r}",
            )
        prefill = model.engine_kwargs | self.prefill.engine_kwargs
        decode = model.engine_kwargs | self.decode.engine_kwargs
        connectors = [
            (kwargs.get("kv_transfer_config") or _DEFAULT_CONNECTOR).get("kv_connector")
            for kwargs in (prefill, decode)
        ]
        require(
            connectors[0] == connectors[1],
            f"{path}.decode.engine_kwargs.kv_transfer_config.kv_connector",
            f"must equal the prefill pool's ({connectors[0]!r}), got {connectors[1]!r}",
        )
        for key in _SAME_KV_LAYOUT:
            require(
                prefill.get(key) == decode.get(key),
                f"{path}.decode.engine_kwargs.{key}",
                f"must equal the prefill pool's ({prefill.get(key)!r}), got {decode.get(key)!r}: "
                "the decode pool reads the prefill pool's KV blocks as they are (only the TP "
                "size may differ: blocks are re-sharded by KV head)",
            )


_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class ModelDeployment:
    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    deployment_config: ServeDeploymentConfig = field(default_factory=ServeDeploymentConfig)
    accelerator_type: str | None = None
    placement_group_config: PlacementGroupConfig = field(default_factory=PlacementGroupConfig)
    lora_config: LoraConfig | None = None
    disaggregation: DisaggregationConfig | None = None
    sleep_config: SleepConfig | None = None

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    def pools(self) -> list[tuple[str | None, ModelDeployment]]:
        """The Serve deployments this model runs as: itself (role None), or its prefill and
        decode pools, each a model of its own (its engine_kwargs over the model's, the
        connector's role set, its deployment_config)."""
        disaggregation = self.disaggregation
        if disaggregation is None:
            return [(None, self)]
        pools = []
        for role in ("prefill", "decode"):
            pool: PoolConfig = getattr(disaggregation, role)
            kwargs = self.engine_kwargs | pool.engine_kwargs
            transfer = dict(kwargs.get("kv_transfer_config") or _DEFAULT_CONNECTOR)
            kwargs["kv_transfer_config"] = {**transfer, "kv_role": _KV_ROLES[role]}
            deployment = pool.deployment_config
            if role == "decode" and deployment.request_router is None:
                # Prefill is routed by prefix (its cache hits), decode by load (pow2).
                deployment = dataclasses.replace(deployment, request_router="pow2")
            pools.append((role, dataclasses.replace(
                self, engine_kwargs=kwargs, deployment_config=deployment, disaggregation=None,
            )))  # fmt: skip
        return pools

    def engine_args(self) -> dict[str, Any]:
        """The full engine arguments: ``model`` from ``model_source`` plus ``engine_kwargs``
        (``device`` cpu where no GPU is reserved); with ``lora_config``, LoRA is enabled and
        the engine's host-side adapter cache holds every adapter a replica may keep."""
        args = {"model": self.model_loading_config.source, **self.engine_kwargs}
        if not self.uses_gpu and args.get("device", "auto") == "auto":
            args["device"] = "cpu"  # placed without a GPU: never one Ray did not reserve
        if self.lora_config is not None:
            args["enable_lora"] = True
            wanted = max(self.lora_config.max_num_adapters_per_replica, args.get("max_loras", 1))
            args.setdefault("max_cpu_loras", wanted)
        return args

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.num_tp_groups

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size", 1))

    @property
    def num_tp_groups(self) -> int:
        """One per pipeline stage, or per data-parallel rank (the two do not combine)."""
        kw = self.engine_kwargs
        return int(kw.get("pipeline_parallel_size", 1)) * int(kw.get("data_parallel_size", 1))

    @property
    def uses_gpu(self) -> bool:
        """GPU when an accelerator type is named or the device is cuda; CPU otherwise."""
        device = self.engine_kwargs.get("device", "auto")
        return device == "cuda" or (device != "cpu" and self.accelerator_type is not None)

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """The replica's bundles: its front (bundle 0), its head (``HEAD_BUNDLE_INDEX``), then
        one bundle per pipeline stage (or data-parallel rank) holding its TP group's devices
        (``{"GPU": TP}``), each worker's share as ``placement_group_config.bundles`` gives it.

        The front (the Serve replica: templates, tokenizing, streams) and the head (the engine
        core) are separate processes. With TP = PP = 1 the head runs the worker itself, so its
        bundle holds the device (``{"CPU": 1, "GPU": 0.49}`` with ``bundles: [{GPU: 0.49}]``:
        a share of one GPU, which other replicas' heads may hold the rest of); otherwise (or
        with ``distributed_executor_backend: ray``) the head only schedules and the worker
        actors each take their share of their stage's bundle. A bundle never spans nodes, so
        a TP group (an all-reduce per layer) stays on one node whatever the strategy; PACK (the
        default) still lets stages sit on different nodes when no one node has room for all
        (``cluster.runtime.ray_executor``).
        """
        unit = "GPU" if self.uses_gpu else "CPU"
        accelerator: dict[str, float] = {}
        if self.uses_gpu and self.accelerator_type:
            accelerator[f"accelerator_type:{self.accelerator_type}"] = 0.001
        front = {"CPU": 1.0}
        workers = [
            self.placement_group_config.worker_bundle(rank, unit) for rank in range(self.world_size)
        ]
        if self.world_size == 1 and self.engine_kwargs.get("distributed_executor_backend") != "ray":
            (worker,) = workers
            if not self.uses_gpu:
                return [front, worker]
            # The head process is the worker: one CPU unless the bundle names its own.
            return [front, {"CPU": worker.get("CPU", 1.0), "GPU": worker["GPU"], **accelerator}]
        tp = self.tensor_parallel_size
        stages = []
        for stage in range(self.num_tp_groups):
            bundle: dict[str, float] = {}
            for worker in workers[stage * tp : (stage + 1) * tp]:
                for key, amount in worker.items():
                    bundle[key] = bundle.get(key, 0.0) + amount
            stages.append({**bundle, **accelerator})
        return [front, {"CPU": 1.0}] + stages

    def head_resources(self) -> dict[str, float]:
        """The CPUs and devices of the head's bundle, which its actor asks for (with TP = PP =
        1 the device share too: ``{"CPU": 1, "GPU": 0.49}``)."""
        head = self.placement_group_bundles()[HEAD_BUNDLE_INDEX]
        return {key: amount for key, amount in head.items() if key in ("CPU", "GPU")}

    @property
    def max_replicas(self) -> int:
        return self.deployment_config.max_replicas

    def cpus_at_max_scale(self) -> float:
        """Logical CPUs this model's replicas reserve at ``max_replicas`` (front, head and
        CPU workers; both pools of a disaggregated model): what a local cluster must offer so
        that none of them waits forever."""
        if self.disaggregation is not None:
            return sum(pool.cpus_at_max_scale() for _, pool in self.pools())
        per_replica = sum(b.get("CPU", 0.0) for b in self.placement_group_bundles())
        return per_replica * self.max_replicas

    def serve_options(self) -> dict[str, Any]:
        options = self.deployment_config.serve_options()
        router = options["request_router_config"]
        if "request_router_kwargs" in router and not self.has_node_kv_store:
            router["request_router_kwargs"]["kv_store_credit"] = 0.0
        return {
            **options,
            "placement_group_bundles": self.placement_group_bundles(),
            "placement_group_strategy": self.placement_group_config.strategy,
        }

    @property
    def has_node_kv_store(self) -> bool:
        """Whether the model's replicas load blocks from their node's KV store."""
        transfer = self.engine_kwargs.get("kv_transfer_config") or {}
        return transfer.get("kv_connector") == "SharedStorageConnector" and transfer.get(
            "kv_role", "kv_both") != "kv_producer"  # fmt: skip


@dataclass(frozen=True)
class SleepModeConfig:
    """``sleep_mode``: of the models with a ``sleep_config``, at most ``max_awake_models`` are
    awake at once; a request to a sleeping one first puts the least recently used awake one to
    sleep (``cluster.serving.awake_models``), so more models share the devices than fit."""

    max_awake_models: int | None = None

    def check(self, path: str, config: DeploymentConfig) -> None:
        if self.max_awake_models is None:
            return
        check_int(self.max_awake_models, f"{path}.max_awake_models", ge=1)
        require(
            any(m.sleep_config is not None for m in config.models),
            f"{path}.max_awake_models",
            "needs models with a sleep_config (the models that take turns)",
        )
        require(
            config.http_options.ingress_replicas == 1,
            f"{path}.max_awake_models",
            "needs http_options.ingress_replicas 1 (the ingress keeps the awake set), got "
            f"{config.http_options.ingress_replicas}",
        )
        # Models on GPU shares may each ask for more memory than their share (check_placement):
        # the awake ones, wherever Ray put them (all on one GPU, at worst), must fit together.
        shared = sorted(
            (float(pool.engine_kwargs["gpu_memory_utilization"]) * pool.max_replicas, m.model_id)
            for m in config.models
            if m.sleep_config is not None
            for _, pool in m.pools()
            if pool.uses_gpu and pool.placement_group_config.device_share("GPU") < 1
        )
        awake = shared[-self.max_awake_models :]
        require(
            sum(u for u, _ in awake) <= 1 + 1e-9,
            f"{path}.max_awake_models",
            f"{self.max_awake_models} models on GPU shares may be awake at once and Ray may "
            "put them on one GPU, so the largest gpu_memory_utilization x max_replicas among "
            f"them must sum to at most 1, got {' + '.join(f'{u:g} ({m})' for u, m in awake)}",
        )


@dataclass(frozen=True)
class DeploymentConfig:
    models: list[ModelDeployment]
    http_options: HTTPOptions = field(default_factory=HTTPOptions)
    grpc_options: GRPCOptions | None = None
    api_keys: APIKeysConfig | None = None
    responses_store: ResponsesStoreConfig = field(default_factory=ResponsesStoreConfig)
    sleep_mode: SleepModeConfig = field(default_factory=SleepModeConfig)
    # Image inputs (cluster.api.media): where an image URL may be fetched from, and the caps.
    media: MediaSettings = field(default_factory=MediaSettings)
    app_name: str = "llm"

    def awake_spec(self) -> tuple[dict[str, int], int, float] | None:
        """What the ingress's awake set needs (``SleepModeConfig``): each sleeping model's
        level (in config order: the first ``max_awake_models`` start awake), the limit, and
        how long a request waits for room."""
        limit = self.sleep_mode.max_awake_models
        sleepers = [m for m in self.models if m.sleep_config is not None]
        if limit is None or not sleepers:
            return None
        levels = {m.model_id: m.sleep_config.level for m in sleepers if m.sleep_config}
        return levels, limit, max(m.sleep_config.wake_timeout_s for m in sleepers if m.sleep_config)

    def starts_asleep(self, model_id: str) -> bool:
        """Whether ``model_id``'s replicas start asleep, their engine not started: the models
        with a ``sleep_config`` after the first ``sleep_mode.max_awake_models``, so that at
        start-up no more are loaded than may be awake at once."""
        spec = self.awake_spec()
        return spec is not None and model_id in list(spec[0])[spec[1] :]

    def model(self, model_id: str) -> ModelDeployment:
        for model in self.models:
            if model.model_id == model_id:
                return model
        raise KeyError(model_id)


# ---- loading and checking --------------------------------------------------------------------


def load_config(source: str | os.PathLike[str] | dict[str, Any]) -> DeploymentConfig:
    """Parse and fully validate a deployment config (a YAML path or an already-parsed dict).
    Raises ``ConfigError`` naming the key path; touches no cluster."""
    config = parse_config(source)
    check_config(config)
    return config


def parse_config(source: str | os.PathLike[str] | dict[str, Any]) -> DeploymentConfig:
    """The config's fields and types, not yet their values (``check_config``, which reads the
    checkpoint and takes seconds): what ``cluster serve`` needs to refuse a busy port at once."""
    data = source if isinstance(source, dict) else load_yaml_file(source)
    return build_dataclass(DeploymentConfig, data)


def check_config(config: DeploymentConfig) -> None:
    require(bool(config.models), "models", "must list at least one model, got []")
    seen: dict[str, str] = {}  # Serve deployment name -> the model id it was made from
    for i, model in enumerate(config.models):
        path = f"models[{i}]"
        check_model_id(model.model_id, f"{path}.model_loading_config.model_id", seen)
        model.model_loading_config.check(f"{path}.model_loading_config")
        model.deployment_config.check(f"{path}.deployment_config")
        check_accelerator_type(model.accelerator_type, f"{path}.accelerator_type")
        require(
            model.disaggregation is None or model.deployment_config == ServeDeploymentConfig(),
            f"{path}.deployment_config",
            "is not used by a disaggregated model: each pool is a Serve deployment of its own; "
            "put it under disaggregation.prefill.deployment_config and/or "
            "disaggregation.decode.deployment_config",
        )
        if model.lora_config is not None:
            model.lora_config.check(f"{path}.lora_config")
            enable = model.engine_kwargs.get("enable_lora", True) is True
            require(enable, f"{path}.engine_kwargs.enable_lora", "cannot be false with lora_config")
        read_chat_templates(model, path)
        check_engine_kwargs(model, f"{path}.engine_kwargs")
        if model.disaggregation is not None:  # first: the checks below read its pools
            model.disaggregation.check(f"{path}.disaggregation", model)
            for role, pool in model.pools():
                check_engine_kwargs(pool, f"{path}.disaggregation.{role}.engine_kwargs")
        if model.sleep_config is not None:
            model.sleep_config.check(f"{path}.sleep_config")
            require(
                int(model.engine_kwargs.get("data_parallel_size", 1)) == 1,
                f"{path}.sleep_config",
                "needs data_parallel_size 1 (data-parallel engines do not sleep yet)",
            )
            connectors = {(p.engine_kwargs.get("kv_transfer_config") or {}).get("kv_connector")
                          for _, p in model.pools()}  # fmt: skip
            require(
                "NixlConnector" not in connectors,
                f"{path}.sleep_config",
                "cannot be set with kv_connector NixlConnector (its agents registered the KV "
                "cache's memory for other engines to read)",
            )
        for role, pool in model.pools():
            kwargs_path = f"{path}.engine_kwargs" if role is None else (
                f"{path}.disaggregation.{role}.engine_kwargs")  # fmt: skip
            takes_turns = model.sleep_config is not None and (
                config.sleep_mode.max_awake_models is not None)  # fmt: skip
            check_placement(pool, f"{path}.placement_group_config", kwargs_path, takes_turns)
    check_app_name(config.app_name, "app_name")
    config.http_options.check("http_options")
    config.responses_store.check("responses_store")
    config.sleep_mode.check("sleep_mode", config)
    if config.grpc_options is not None:
        config.grpc_options.check("grpc_options")
        http_port = config.http_options.port
        require(
            config.grpc_options.port != http_port or http_port == 0,
            "grpc_options.port",
            f"must differ from http_options.port ({http_port}): the gRPC and HTTP servers "
            "each listen on their own port",
        )
    if config.api_keys is not None:
        config.api_keys.check("api_keys")


def check_placement(
    model: ModelDeployment, path: str, kwargs_path: str, takes_turns: bool = False
) -> None:
    """``placement_group_config`` against the model's workers; with a fraction of a GPU per
    replica, ``gpu_memory_utilization`` (the memory each instance may take, whatever else is
    on its GPU) must be set and at most that fraction: Ray fills a GPU with shares that sum to
    at most 1, so the instances it puts together then fit its memory together. A model that
    ``takes_turns`` (``sleep_mode``) may ask for more: ``SleepModeConfig.check`` bounds what
    the awake ones hold together."""
    unit = "GPU" if model.uses_gpu else "CPU"
    model.placement_group_config.check(path, unit, model.world_size)
    share = model.placement_group_config.device_share(unit)
    if unit != "GPU" or share == 1:
        return
    utilization = model.engine_kwargs.get("gpu_memory_utilization")
    require(
        utilization is not None and (takes_turns or utilization <= share),
        f"{kwargs_path}.gpu_memory_utilization",
        f"must be set to at most {share:g} (placement_group_config.bundles' GPU share) when "
        f"replicas share a GPU, got {utilization!r}: each instance takes that fraction of its "
        "GPU's memory, so the replicas Ray puts on one GPU must fit it together",
    )


def read_chat_templates(model: ModelDeployment, path: str) -> None:
    """A ``chat_template`` file is read here, where the config is loaded (a relative path from
    this working directory, as vLLM's): its text goes to the replicas, on other nodes."""
    from engine.config_sections import load_chat_template  # torch: see check_engine_kwargs

    sides = [("", model.engine_kwargs)]
    if model.disaggregation is not None:
        sides += [(f".disaggregation.{role}", getattr(model.disaggregation, role).engine_kwargs)
                  for role in ("prefill", "decode")]  # fmt: skip
    for where, kwargs in sides:
        if "chat_template" in kwargs:
            try:
                kwargs["chat_template"] = load_chat_template(kwargs["chat_template"])
            except ConfigError as exc:
                raise ConfigError(f"{path}{where}.engine_kwargs.{exc}") from None


def check_engine_kwargs(model: ModelDeployment, path: str) -> None:
    """Names and ranges always; the model-shape checks (TP divides heads, max_model_len within
    the checkpoint's limit) and what the engine refuses in the checkpoint's config.json (its
    architecture, ...: named under ``model_source``) too when the checkpoint is reachable from
    this machine — a production path like /models/... usually exists only on the GPU nodes,
    whose replicas then refuse it (``cluster.serving.start_errors``)."""
    # Imported here: engine.config pulls in torch, which the processes that only read a
    # config (the ingress, the CLI's status and shutdown) never need.
    from engine.config import (
        ENGINE_ARG_NAMES,
        EngineConfig,
        check_engine_arg_names,
        check_engine_arg_ranges,
    )

    kwargs = model.engine_kwargs
    check_engine_arg_names(kwargs, path=f"{path}.")
    require("model" not in kwargs, f"{path}.model", "set the model in model_loading_config")
    require(
        "placement_group_strategy" not in kwargs,
        f"{path}.placement_group_strategy",
        "is the offline engine's: Serve places a deployment's replica by its placement group, "
        "so set placement_group_config.strategy instead",
    )
    parser = kwargs.get("tool_call_parser")
    if isinstance(parser, str) and parser not in TOOL_PARSERS:
        names = ", ".join(sorted(TOOL_PARSERS))
        raise ConfigError(f"{path}.tool_call_parser: unknown parser {parser!r}; one of {names}")
    reasoning = kwargs.get("reasoning_parser")
    if isinstance(reasoning, str) and reasoning not in REASONING_PARSERS:
        names = ", ".join(sorted(REASONING_PARSERS))
        raise ConfigError(f"{path}.reasoning_parser: unknown parser {reasoning!r}; one of {names}")
    source = model.model_loading_config.source
    where = path.removesuffix(".engine_kwargs") + ".model_loading_config.model_source"
    try:
        check_engine_arg_ranges(kwargs)
        if _checkpoint_reachable(source):
            EngineConfig.from_kwargs(**model.engine_args())
    except ConfigError as exc:
        key, _, rest = str(exc).partition(":")
        if key == "model":  # the checkpoint itself (an s3:// store it cannot read, ...)
            raise ConfigError(f"{where}:{rest}") from None
        key = re.split(r"[.:\[]", str(exc), maxsplit=1)[0]
        if key in ENGINE_ARG_NAMES:
            raise ConfigError(f"{path}.{exc}") from None
        if key in (kwargs.get("hf_overrides") or {}):  # the override's value, not config.json's
            raise ConfigError(f"{path}.hf_overrides.{exc}") from None
        # A field of the checkpoint's config.json the engine refuses (its architecture, ...).
        raise ConfigError(f"{where}: {source} (config.json): {exc}") from None
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _checkpoint_reachable(source: str) -> bool:
    """A built-in, a local directory with a config.json, or an s3:// URI (whose config check
    reads the small files and the safetensors headers from the store, not the weights)."""
    return (
        source.startswith("builtin:")
        or is_s3_uri(source)
        or (Path(source).expanduser() / "config.json").is_file()
    )
