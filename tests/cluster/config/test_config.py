"""The deployment YAML: the shipped configs validate, Serve options come out with Serve's
names and TP x PP worker bundles, and every error names its key path."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import DRAIN_ABORT_MARGIN_S, DeploymentConfig, load_config
from engine.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def tiny() -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / "tiny.yaml").read_text())


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data)
    return str(info.value)


@pytest.mark.parametrize(
    "name",
    [
        "tiny.yaml",
        "multi-model.yaml",
        "llama70b.yaml",
        "qwen3-8b.yaml",
        "gemma2-27b.yaml",
        "gemma3-12b.yaml",
        "gemma3-4b-it.yaml",
        "phi3-mini-128k.yaml",
        "mistral-7b-v0.1.yaml",
        "qwen3-30b-a3b.yaml",
        "tiny-families.yaml",
        "deepseek-v3.yaml",
        "kimi-k2.yaml",
        "glm-4.6.yaml",
        "gpt-oss-120b.yaml",
        "retrieval.yaml",
        "tiny-retrieval.yaml",
        "tiny-qwen2.5-vl.yaml",
    ],
)
def test_shipped_configs_validate(name: str) -> None:
    assert isinstance(load_config(CONFIGS / name), DeploymentConfig)


def test_llama70b_is_tp4_pp2_on_h100_with_autoscaling_1_to_4() -> None:
    model = load_config(CONFIGS / "llama70b.yaml").models[0]
    options = model.serve_options()
    bundles = options["placement_group_bundles"]
    assert bundles[:2] == [{"CPU": 1.0}, {"CPU": 1.0}]  # the front, the head
    # One bundle per pipeline stage holding its TP group's GPUs: a bundle never spans nodes.
    assert bundles[2:] == [{"GPU": 4.0, "accelerator_type:H100": 0.001}] * 2
    assert options["placement_group_strategy"] == "PACK"
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 4)
    assert "num_replicas" not in options
    assert model.engine_kwargs["enable_prefix_caching"] is True
    assert model.engine_kwargs["dtype"] == "bfloat16"
    assert model.engine_kwargs["max_model_len"] == 8192


def test_tiny_config_is_a_front_and_a_head_bundle_and_one_replica() -> None:
    options = load_config(CONFIGS / "tiny.yaml").models[0].serve_options()
    # The head runs the one worker itself, so its bundle is the device's.
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert options["num_replicas"] == 1


def test_one_worker_on_the_ray_backend_gets_its_own_bundle() -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"]["distributed_executor_backend"] = "ray"
    options = load_config(data).models[0].serve_options()
    assert options["placement_group_bundles"] == [{"CPU": 1.0}] * 3


def test_serve_force_kills_a_stopping_replica_only_after_its_drain() -> None:
    data = tiny()
    data["models"][0]["deployment_config"]["graceful_shutdown_timeout_s"] = 7
    options = load_config(data).models[0].serve_options()
    assert options["graceful_shutdown_timeout_s"] == 7 + DRAIN_ABORT_MARGIN_S


def test_unknown_engine_kwarg_names_its_path() -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"]["foo"] = 1
    assert error_of(data).startswith("models[0].engine_kwargs.foo: unknown engine argument")


def test_misspelled_engine_kwarg_suggests_the_name() -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"]["max_model_length"] = 1
    assert "did you mean 'max_model_len'" in error_of(data)


def test_out_of_range_engine_kwarg_names_its_path() -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"]["gpu_memory_utilization"] = 1.5
    assert error_of(data) == (
        "models[0].engine_kwargs.gpu_memory_utilization: must be a number in (0, 1], got 1.5"
    )


def test_model_shape_is_checked_when_the_checkpoint_is_reachable() -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"]["tensor_parallel_size"] = 3
    assert error_of(data).startswith("models[0].engine_kwargs.tensor_parallel_size: must divide")


def test_a_bad_hf_override_is_named_as_the_override_not_the_checkpoints_config() -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"]["hf_overrides"] = {"num_attention_heads": 0}
    assert error_of(data).startswith(
        "models[0].engine_kwargs.hf_overrides.num_attention_heads: must be a positive integer"
    )


@pytest.mark.parametrize(
    ("device", "accelerator", "engine_device"),
    [(None, None, "cpu"), ("auto", None, "cpu"), (None, "H100", None), ("cuda", None, "cuda"),
     ("cpu", None, "cpu")],
)  # fmt: skip
def test_a_replica_without_a_reserved_gpu_runs_its_engine_on_cpu(
    device: str | None, accelerator: str | None, engine_device: str | None
) -> None:
    """Placed on CPU bundles (no accelerator_type), ``device: auto`` would still take a GPU
    the node has, one Ray never reserved for it."""
    data = yaml.safe_load((CONFIGS / "llama70b.yaml").read_text())
    model = data["models"][0]
    model.pop("accelerator_type", None)
    model["engine_kwargs"].pop("device", None)
    if device is not None:
        model["engine_kwargs"]["device"] = device
    if accelerator is not None:
        model["accelerator_type"] = accelerator
    args = load_config(data).models[0].engine_args()
    assert args.get("device") == engine_device


def test_absent_checkpoint_still_gets_name_and_range_checks() -> None:
    data = yaml.safe_load((CONFIGS / "llama70b.yaml").read_text())
    data["models"][0]["engine_kwargs"]["block_size"] = 12
    assert error_of(data) == (
        "models[0].engine_kwargs.block_size: must be one of 8, 16, 32, 64, 128, got 12"
    )


def test_unknown_top_level_and_nested_keys_are_rejected() -> None:
    data = tiny()
    data["http_option"] = {}
    assert error_of(data).startswith("http_option: unknown key")
    data = tiny()
    data["models"][0]["deployment_config"]["replicas"] = 2
    assert error_of(data).startswith("models[0].deployment_config.replicas: unknown key")


def test_wrong_type_names_the_path() -> None:
    data = tiny()
    data["models"][0]["deployment_config"]["max_ongoing_requests"] = "many"
    assert error_of(data) == "models[0].deployment_config.max_ongoing_requests: must be an " \
        "integer, got 'many'"  # fmt: skip


def test_missing_model_id_is_required() -> None:
    data = tiny()
    del data["models"][0]["model_loading_config"]["model_id"]
    assert error_of(data) == "models[0].model_loading_config.model_id: is required"


def test_duplicate_model_ids_are_rejected() -> None:
    data = tiny()
    data["models"].append(copy.deepcopy(data["models"][0]))
    assert error_of(data).startswith("models[1].model_loading_config.model_id:")


def test_num_replicas_and_autoscaling_are_exclusive() -> None:
    data = tiny()
    data["models"][0]["deployment_config"]["autoscaling_config"] = {"max_replicas": 2}
    assert error_of(data).startswith("models[0].deployment_config.num_replicas: cannot be set")


def test_autoscaling_bounds_are_checked() -> None:
    data = tiny()
    dc = data["models"][0]["deployment_config"]
    del dc["num_replicas"]
    dc["autoscaling_config"] = {"min_replicas": 3, "max_replicas": 2}
    assert error_of(data) == (
        "models[0].deployment_config.autoscaling_config.max_replicas: "
        "must be an integer >= 3 (min_replicas), got 2"
    )


def autoscaled(**scaling: Any) -> dict[str, Any]:
    data = tiny()
    dc = data["models"][0]["deployment_config"]
    del dc["num_replicas"]
    dc["autoscaling_config"] = scaling
    return data


def test_multi_replica_models_default_to_the_prefix_aware_router() -> None:
    options = load_config(autoscaled(min_replicas=1, max_replicas=2)).models[0].serve_options()
    router = options["request_router_config"]
    assert router["request_router_class"] == "cluster.serving.prefix_router:PrefixAwareRouter"
    assert router["request_router_kwargs"]["balance_abs_threshold"] == 4
    assert router["request_routing_stats_period_s"] == 1.0


def test_one_replica_models_and_request_router_pow2_use_serves_router() -> None:
    single = load_config(tiny()).models[0].serve_options()["request_router_config"]
    assert single["request_router_class"].endswith(":PowerOfTwoChoicesRequestRouter")
    data = autoscaled(max_replicas=2)
    data["models"][0]["deployment_config"]["request_router"] = "pow2"
    options = load_config(data).models[0].serve_options()
    assert options["request_router_config"]["request_router_class"].endswith(
        ":PowerOfTwoChoicesRequestRouter"
    )


def test_an_unknown_request_router_and_bad_prefix_router_knobs_name_their_key() -> None:
    data = tiny()
    data["models"][0]["deployment_config"]["request_router"] = "round_robin"
    assert error_of(data) == (
        "models[0].deployment_config.request_router: "
        "must be one of 'prefix_aware', 'pow2', got 'round_robin'"
    )
    data = tiny()
    data["models"][0]["deployment_config"]["prefix_router"] = {"balance_rel_threshold": 0.5}
    assert error_of(data) == (
        "models[0].deployment_config.prefix_router.balance_rel_threshold: "
        "must be a number >= 1, got 0.5"
    )
    data["models"][0]["deployment_config"]["prefix_router"] = {"chunk_size": 5}
    assert error_of(data).startswith(
        "models[0].deployment_config.prefix_router.chunk_size: unknown key"
    )


def test_the_engine_autoscaling_policy_gets_its_targets_as_policy_kwargs() -> None:
    data = autoscaled(min_replicas=0, max_replicas=2, target_num_waiting=3,
                      downscale_to_zero_delay_s=5)  # fmt: skip
    model = load_config(data).models[0]
    scaling = model.serve_options()["autoscaling_config"]
    assert scaling["policy"] == {
        "policy_function": "cluster.serving.autoscaling_policy:EngineSignalPolicy",
        "policy_kwargs": {"target_num_waiting": 3.0, "target_kv_usage": 0.85},
    }
    assert scaling["min_replicas"] == 0 and scaling["downscale_to_zero_delay_s"] == 5
    assert "target_num_waiting" not in scaling
    assert model.deployment_config.scales_to_zero


def test_serves_own_autoscaling_policy_can_be_chosen() -> None:
    model = load_config(autoscaled(max_replicas=2, policy="ongoing_requests")).models[0]
    assert "policy" not in model.serve_options()["autoscaling_config"]


def test_serve_accepts_the_generated_options() -> None:
    from ray import serve

    from cluster.serving.llm_server import LLMServer

    data = autoscaled(min_replicas=0, max_replicas=2)
    options = load_config(data).models[0].serve_options()
    deployment = serve.deployment(LLMServer).options(**options)
    config = deployment._deployment_config
    assert config.request_router_config.request_router_class.endswith("PrefixAwareRouter")
    assert config.autoscaling_config.policy.policy_kwargs["target_kv_usage"] == 0.85


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("target_kv_usage", 0, "must be a number in (0, 1], got 0.0"),
        ("target_num_waiting", -1, "must be a number > 0, got -1.0"),
        ("policy", "fancy", "must be one of 'engine', 'ongoing_requests', got 'fancy'"),
        ("downscale_to_zero_delay_s", -1, "must be a number >= 0 or null, got -1.0"),
    ],
)
def test_engine_policy_targets_are_checked(key: str, value: Any, message: str) -> None:
    error = error_of(autoscaled(max_replicas=2, **{key: value}))
    assert error == f"models[0].deployment_config.autoscaling_config.{key}: {message}"


def test_api_keys_need_exactly_one_source() -> None:
    data = tiny()
    data["api_keys"] = {"env": "A", "file": "/b"}
    assert error_of(data).startswith("api_keys: set exactly one of")


def test_api_keys_from_env_are_shipped_only_as_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_KEYS", "k1, k2")
    data = tiny()
    data["api_keys"] = {"env": "TEST_KEYS"}
    hashes = load_config(data).api_keys.load_key_hashes()
    assert hashes == [hashlib.sha256(k).hexdigest() for k in (b"k1", b"k2")]


def test_api_keys_from_a_missing_env_var_name_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_KEYS", raising=False)
    data = tiny()
    data["api_keys"] = {"env": "TEST_KEYS"}
    with pytest.raises(ConfigError, match=r"api_keys\.env: environment variable 'TEST_KEYS'"):
        load_config(data).api_keys.load_key_hashes()


def test_missing_file_and_invalid_yaml_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_replicas_get_every_variable_the_engine_reads_and_not_the_api_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """engine/envs.py is read in the replicas' processes: each of its variables set on the
    driver reaches them through the app's runtime_env; other LLM_CLUSTER_* variables (API
    keys) do not."""
    import re

    from cluster.serving.serve import runtime_env

    source = (Path(__file__).resolve().parents[3] / "engine" / "envs.py").read_text()
    names = set(re.findall(r'"((?:LLM_CLUSTER|VLLM)_[A-Z_]+)"', source))
    assert {"LLM_CLUSTER_LOAD_TIMEOUT_S", "VLLM_PP_LAYER_PARTITION"} <= names
    for name in names:
        monkeypatch.setenv(name, "7")
    monkeypatch.setenv("LLM_CLUSTER_API_KEYS", "sk-secret")
    env = runtime_env()["env_vars"]
    assert {name: env.get(name) for name in names} == dict.fromkeys(names, "7")
    assert "LLM_CLUSTER_API_KEYS" not in env


@pytest.mark.parametrize("value", [0, -1.5, "600"])
def test_request_timeout_must_be_positive_seconds(value: Any) -> None:
    data = tiny()
    data.setdefault("http_options", {})["request_timeout_s"] = value
    assert "http_options.request_timeout_s" in error_of(data)


@pytest.mark.parametrize("timeout", [None, 600])
def test_serve_starts_with_the_configs_request_timeout(
    monkeypatch: pytest.MonkeyPatch, timeout: float | None
) -> None:
    """``http_options.request_timeout_s`` reaches Serve's HTTP options (its 408, behind the
    proxy and on the ingress replica alike); unset, Serve's own default (none) stays."""
    from cluster.ops import deploy

    data = tiny()
    data.setdefault("http_options", {})["request_timeout_s"] = timeout
    started: list[dict[str, Any]] = []
    monkeypatch.setattr(deploy.serve, "start", lambda **kwargs: started.append(kwargs))
    deploy.start_serve(load_config(data))
    (kwargs,) = started
    assert kwargs["http_options"].get("request_timeout_s") == timeout


@pytest.mark.parametrize("reader", ["parse_config", "load_unchecked"])
def test_a_key_given_twice_names_it_and_both_lines(tmp_path: Path, reader: str) -> None:
    """PyYAML keeps the last of two equal keys: a copied block would silently replace the
    first (here the device and max_model_len would be gone)."""
    from cluster.config import parse_config
    from cluster.ops.plan import load_unchecked

    path = tmp_path / "dup.yaml"
    path.write_text(
        "models:\n"
        "  - model_loading_config: {model_id: m, model_source: builtin:tiny-llama}\n"
        "    engine_kwargs: {device: cpu, max_model_len: 512}\n"
        "    deployment_config: {num_replicas: 1}\n"
        "    engine_kwargs: {max_num_seqs: 8}\n"
    )
    if reader == "load_unchecked":  # the plan's reader refuses the structure: no config
        assert load_unchecked(str(path)) is None
        return
    with pytest.raises(ConfigError) as info:
        parse_config(path)
    assert str(info.value) == (
        f"{path}: line 5: key 'engine_kwargs' given twice (first at line 3); "
        "the second would silently replace the first"
    )


def test_model_ids_with_one_serve_deployment_name_are_refused() -> None:
    data = tiny()
    second = copy.deepcopy(data["models"][0])
    data["models"][0]["model_loading_config"]["model_id"] = "org/m"
    second["model_loading_config"]["model_id"] = "org m"
    data["models"].append(second)
    assert error_of(data) == (
        "models[1].model_loading_config.model_id: 'org m' has the Serve deployment name "
        "'LLMServer:org-m' of the earlier model 'org/m' (a character other than letters, "
        "digits, '_', '.' and '-' becomes '-'): choose ids that differ in those"
    )


@pytest.mark.parametrize(("given", "suggested"), [("h100", "'H100'"), ("H100-SXM", "'H100'")])
def test_an_unknown_accelerator_type_is_refused_with_rays_name(given: str, suggested: str) -> None:
    data = tiny()
    data["models"][0]["accelerator_type"] = given
    error = error_of(data)
    assert error.startswith(f"models[0].accelerator_type: unknown accelerator type {given!r}")
    assert f"did you mean {suggested}" in error


def test_the_accelerator_type_names_are_rays() -> None:
    from ray.util.accelerators import accelerators

    from cluster.config.ray_names import RAY_ACCELERATOR_TYPES

    names = {v for k, v in vars(accelerators).items() if not k.startswith("_")
             and isinstance(v, str)}  # fmt: skip
    assert names == RAY_ACCELERATOR_TYPES


def test_the_engine_placement_strategy_points_to_the_placement_group_config() -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"]["placement_group_strategy"] = "STRICT_SPREAD"
    error = error_of(data)
    assert error.startswith("models[0].engine_kwargs.placement_group_strategy: ")
    assert "placement_group_config.strategy" in error


@pytest.mark.parametrize(
    ("engine_kwargs", "message"),
    [
        ({"tokenizer": 5}, "tokenizer: must be a non-empty string or null, got 5"),
        ({"tokenizer": "/nonexistent/tok"}, "tokenizer: '/nonexistent/tok' is not a directory"),
        (
            {"pipeline_parallel_size": 2, "pp_layer_partition": 3},
            "pp_layer_partition: must list 2 positive layer counts (one per pipeline stage), got 3",
        ),
        ({1: 2}, "1: engine argument names must be strings, got int 1"),
        ({True: 2}, "True: engine argument names must be strings, got bool True"),
    ],
)
def test_a_wrong_engine_argument_is_a_config_error_naming_it(
    engine_kwargs: dict[Any, Any], message: str
) -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"].update(engine_kwargs)
    assert error_of(data).startswith(f"models[0].engine_kwargs.{message}")


def test_a_checkpoint_whose_config_json_is_not_json_names_the_model_source(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n')
    data = tiny()
    data["models"][0]["model_loading_config"]["model_source"] = str(tmp_path)
    assert error_of(data).startswith(
        f"models[0].model_loading_config.model_source: {tmp_path}/config.json is not valid JSON"
    )


def test_the_in_process_executor_with_tensor_parallelism_names_the_backend() -> None:
    data = tiny()
    data["models"][0]["engine_kwargs"].update(
        tensor_parallel_size=2, distributed_executor_backend="uni"
    )
    assert error_of(data) == (
        "models[0].engine_kwargs.distributed_executor_backend: 'uni' runs one worker in the "
        "head's process; tensor_parallel_size 2 x pipeline_parallel_size 1 x data_parallel_size "
        "1 = 2 workers needs 'ray' (or 'auto')"
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "must be a non-empty string (of letters, digits, '_' and '-'), got ''"),
        ("my app", "must be letters, digits, '_' and '-' only, got 'my app'"),
        ("a/b", "must be letters, digits, '_' and '-' only, got 'a/b'"),
    ],
)
def test_an_app_name_serve_or_the_chart_refuses_is_a_config_error(name: str, message: str) -> None:
    data = tiny()
    data["app_name"] = name
    assert error_of(data) == f"app_name: {message}"


def test_an_app_name_of_letters_digits_dashes_and_underscores_is_taken() -> None:
    data = tiny()
    data["app_name"] = "llm-prod_2"
    assert load_config(data).app_name == "llm-prod_2"


def test_the_grpc_port_must_differ_from_the_http_port() -> None:
    data = tiny()
    data["grpc_options"]["port"] = data["http_options"]["port"]
    assert error_of(data) == (
        "grpc_options.port: must differ from http_options.port (8000): the gRPC and HTTP "
        "servers each listen on their own port"
    )


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("", "must be a non-empty string (a host name or IP address), got ''"),
        ("localhost:8000", "must be a host name or IP address without a port, got "
                           "'localhost:8000': the port goes in http_options.port"),
        ("[::1]:8000", "must be a host name or IP address without a port, got '[::1]:8000': "
                       "the port goes in http_options.port"),
        ("bad host", "must be a host name or IP address (0.0.0.0: every interface), got "
                     "'bad host'"),
        ("http://0.0.0.0", "must be a host name or IP address (0.0.0.0: every interface), got "
                           "'http://0.0.0.0'"),
    ],
)  # fmt: skip
def test_an_http_host_that_is_not_a_host_is_a_config_error(host: str, message: str) -> None:
    data = tiny()
    data["http_options"]["host"] = host
    assert error_of(data) == f"http_options.host: {message}"


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1", "::", "::1", "localhost", "node-1.lan"])
def test_an_http_host_name_or_address_is_taken(host: str) -> None:
    data = tiny()
    data["http_options"]["host"] = host
    assert load_config(data).http_options.host == host
