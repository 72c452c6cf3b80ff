"""The deployment YAML: models in the shape of Ray Serve LLM's ``LLMConfig``, plus the app's.

    models:
      - model_loading_config: {model_id: tiny, model_source: builtin:tiny-llama}
        engine_kwargs: {max_model_len: 512}        # vLLM names, checked by engine.config
        deployment_config:                          # Ray Serve's own names
          autoscaling_config: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}
          max_ongoing_requests: 64
        accelerator_type: H100                      # omit for CPU
        placement_group_config: {strategy: PACK}
    http_options: {host: 0.0.0.0, port: 8000}
    grpc_options: {port: 9000}
    api_keys: {env: LLM_CLUSTER_API_KEYS}           # or {file: /etc/llm/keys}; never the keys

Everything is checked before anything is deployed; every error names its key path (unknown
keys; values out of range, with the range and the value given).

    deployment.py       the typed tree, the models' sections, load_config / check_config
    serve_sections.py   Serve's per-model options: replicas, autoscaling, router, placement
    app_sections.py     the front: HTTP, gRPC, API keys, the responses store
    strict_yaml.py      frozen dataclasses from plain YAML data: keys and types

Imported by the ingress and the CLI, so nothing here imports torch (``engine.config`` only
inside ``check_engine_kwargs``).
"""

from cluster.config.app_sections import APIKeysConfig, GRPCOptions, HTTPOptions
from cluster.config.deployment import (
    HEAD_BUNDLE_INDEX,
    BucketMirrorConfig,
    DeploymentConfig,
    DisaggregationConfig,
    LoraConfig,
    ModelDeployment,
    ModelLoadingConfig,
    PoolConfig,
    _checkpoint_reachable,
    check_config,
    check_engine_kwargs,
    load_config,
    parse_config,
)
from cluster.config.ray_names import deployment_name
from cluster.config.serve_sections import (
    DRAIN_ABORT_MARGIN_S,
    ENGINE_AUTOSCALING_POLICY,
    ROUTER_CLASSES,
    AutoscalingConfig,
    AutoscalingPolicyName,
    PlacementGroupConfig,
    PrefixRouterConfig,
    RequestRouterName,
    ServeDeploymentConfig,
    Strategy,
)
from cluster.config.strict_yaml import build_dataclass

# cluster.ops.plan builds a YAML without its checks under this name.
_build = build_dataclass

__all__ = [
    "DRAIN_ABORT_MARGIN_S",
    "ENGINE_AUTOSCALING_POLICY",
    "HEAD_BUNDLE_INDEX",
    "ROUTER_CLASSES",
    "APIKeysConfig",
    "AutoscalingConfig",
    "AutoscalingPolicyName",
    "BucketMirrorConfig",
    "DeploymentConfig",
    "DisaggregationConfig",
    "GRPCOptions",
    "HTTPOptions",
    "LoraConfig",
    "ModelDeployment",
    "ModelLoadingConfig",
    "PlacementGroupConfig",
    "PoolConfig",
    "PrefixRouterConfig",
    "RequestRouterName",
    "ServeDeploymentConfig",
    "Strategy",
    "_build",
    "_checkpoint_reachable",
    "build_dataclass",
    "check_config",
    "check_engine_kwargs",
    "deployment_name",
    "load_config",
    "parse_config",
]
