"""One message format for every refused config value, engine and cluster alike:
``<key or key path>: must be <type and allowed range>, got <value given>``."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest

from cluster.config import load_config
from engine.config_sections import CacheConfig, LoRAConfig, ParallelConfig, SchedulerConfig
from engine.errors import ConfigError
from engine.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive_int,
    check_str,
    describe_range,
    require,
)


def error_of(check: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        check(*args, **kwargs)
    return str(info.value)


# ---- the helpers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bounds", "text"),
    [
        ({"ge": 1}, ">= 1"),
        ({"gt": 0}, "> 0"),
        ({"le": 8}, "<= 8"),
        ({"lt": 8}, "< 8"),
        ({"ge": 0, "le": 65535}, "in [0, 65535]"),
        ({"gt": 0, "le": 1}, "in (0, 1]"),
        ({"ge": 0, "lt": 4}, "in [0, 4)"),
        ({"gt": 0.5, "lt": 2.5}, "in (0.5, 2.5)"),
        ({}, ""),
    ],
)
def test_ranges_are_written_in_interval_notation(bounds: dict[str, float], text: str) -> None:
    assert describe_range(**bounds) == text


def test_require_prefixes_the_key() -> None:
    require(True, "k", "never raised")
    assert error_of(require, False, "a.b[0].c", "must divide 12, got 5") == (
        "a.b[0].c: must divide 12, got 5"
    )


def test_an_out_of_range_integer_names_type_range_and_value() -> None:
    assert (
        error_of(check_int, 0, "max_replicas", ge=1)
        == "max_replicas: must be an integer >= 1, got 0"
    )
    assert error_of(check_positive_int, -3, "max_n") == "max_n: must be an integer >= 1, got -3"


def test_a_wrong_type_gets_the_same_message_as_a_wrong_value() -> None:
    assert error_of(check_int, "8", "port", ge=0, le=65535) == (
        "port: must be an integer in [0, 65535], got '8'"
    )
    assert error_of(check_int, 2.0, "port", ge=0, le=65535) == (
        "port: must be an integer in [0, 65535], got 2.0"
    )


def test_a_bool_is_neither_an_integer_nor_a_number() -> None:
    assert error_of(check_positive_int, True, "max_n") == "max_n: must be an integer >= 1, got True"
    assert error_of(check_number, True, "swap_space", ge=0) == (
        "swap_space: must be a number >= 0, got True"
    )


def test_nan_is_outside_every_range() -> None:
    assert error_of(check_number, math.nan, "x", gt=0) == "x: must be a number > 0, got nan"


def test_a_number_accepts_ints_and_floats_at_a_closed_bound_only() -> None:
    check_number(1, "x", gt=0, le=1)
    check_number(0.5, "x", gt=0, le=1)
    assert error_of(check_number, 0, "x", gt=0, le=1) == "x: must be a number in (0, 1], got 0"


def test_optional_values_accept_none_and_say_so_when_refused() -> None:
    check_int(None, "num_replicas", ge=1, optional=True)
    check_number(None, "metrics_interval_s", gt=0, optional=True)
    check_str(None, "tool_call_parser", optional=True)
    assert error_of(check_int, 0, "num_replicas", ge=1, optional=True) == (
        "num_replicas: must be an integer >= 1 or null, got 0"
    )
    assert error_of(check_int, None, "max_n", ge=1) == "max_n: must be an integer >= 1, got None"


def test_a_bound_from_another_field_is_named_after_the_range() -> None:
    assert error_of(check_int, 2, "max_cpu_loras", ge=4, note="max_loras") == (
        "max_cpu_loras: must be an integer >= 4 (max_loras), got 2"
    )


def test_choices_are_listed_with_the_value_given() -> None:
    check_choice(16, "block_size", (8, 16, 32))
    assert error_of(check_choice, 12, "block_size", (8, 16, 32)) == (
        "block_size: must be one of 8, 16, 32, got 12"
    )
    assert error_of(check_choice, ["a"], "device", ("cpu", "cuda")) == (
        "device: must be one of 'cpu', 'cuda', got ['a']"
    )


def test_a_choice_must_have_its_type_too() -> None:
    """``16.0 == 16``: a float block size passed the check and failed every step later."""
    for value in (16.0, True):
        assert error_of(check_choice, value, "block_size", (1, 16)) == (
            f"block_size: must be one of 1, 16, got {value!r}"
        )
    import numpy as np

    check_choice(np.int64(16), "block_size", (1, 16))  # numpy's integers are integers


def test_null_is_the_default_for_the_arguments_vllm_fills_in() -> None:
    """vLLM declares these ``X | None = None``; YAML written for Ray Serve LLM carries nulls."""
    from engine.config import check_engine_arg_ranges
    from engine.engine_args import NULL_IS_DEFAULT, group_engine_args

    nulls = dict.fromkeys(NULL_IS_DEFAULT)
    check_engine_arg_ranges(nulls)
    assert group_engine_args(nulls) == group_engine_args({})
    with pytest.raises(ConfigError, match="max_waiting_requests"):
        check_engine_arg_ranges({"max_num_queued_reqs": 8})  # vLLM's name: pointed at ours


def test_a_batch_budget_below_max_num_seqs_is_refused_when_both_are_given() -> None:
    from engine.config import check_engine_arg_ranges

    with pytest.raises(ConfigError) as info:
        check_engine_arg_ranges({"max_num_seqs": 64, "max_num_batched_tokens": 32})
    assert str(info.value) == (
        "max_num_batched_tokens: must be an integer >= 64 (max_num_seqs), got 32"
    )
    check_engine_arg_ranges({"max_num_seqs": 32, "max_num_batched_tokens": 32})
    check_engine_arg_ranges({"max_num_batched_tokens": 16})  # the default seqs: not given


def test_bools_and_strings() -> None:
    assert error_of(check_bool, 1, "enforce_eager") == "enforce_eager: must be true or false, got 1"
    assert error_of(check_str, "", "model", non_empty=True) == (
        "model: must be a non-empty string, got ''"
    )


def test_the_helpers_import_no_torch() -> None:
    """``cluster.config`` imports them, and the ingress and CLI import that without torch."""
    code = "import sys, engine.validation; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- the engine's config: the flat vLLM argument name ------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: CacheConfig(gpu_memory_utilization=1.5),
            "gpu_memory_utilization: must be a number in (0, 1], got 1.5",
        ),
        (
            lambda: CacheConfig(cpu_kv_cache_space=0),
            "cpu_kv_cache_space: must be a number > 0 (GiB), got 0",
        ),
        (
            lambda: CacheConfig(block_size=12),
            "block_size: must be one of 8, 16, 32, 64, 128, got 12",
        ),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs: must be an integer >= 1, got 0"),
        (
            lambda: SchedulerConfig(policy="lifo"),  # type: ignore[arg-type]
            "scheduling_policy: must be one of 'fcfs', 'priority', got 'lifo'",
        ),
        (
            lambda: SchedulerConfig(
                enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=2048
            ),
            "max_num_batched_tokens: must be an integer >= 2048 "
            "(max_model_len, as enable_chunked_prefill is false), got 1024",
        ),
        (
            lambda: ParallelConfig(tensor_parallel_size=2, rank=2),
            "rank: must be an integer in [0, 2) (world_size), got 2",
        ),
        (
            lambda: LoRAConfig(max_loras=4, max_cpu_loras=2),
            "max_cpu_loras: must be an integer >= 4 (max_loras), got 2",
        ),
    ],
)
def test_engine_config_errors_name_the_argument_range_and_value(build: Any, message: str) -> None:
    assert error_of(build) == message


# ---- the deployment YAML: the key path ---------------------------------------------------------


def deployment(**overrides: Any) -> dict[str, Any]:
    # A checkpoint path absent here: names, types and ranges are checked, not the model shape.
    model: dict[str, Any] = {
        "model_loading_config": {"model_id": "m", "model_source": "/absent/checkpoint"},
        "deployment_config": {},
    }
    for key, value in overrides.items():
        model["deployment_config"][key] = value
    return {"models": [model]}


def config_error(data: dict[str, Any]) -> str:
    return error_of(load_config, data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            deployment(autoscaling_config={"min_replicas": 0, "max_replicas": 0}),
            "models[0].deployment_config.autoscaling_config.max_replicas: "
            "must be an integer >= 1, got 0",
        ),
        (
            deployment(autoscaling_config={"max_replicas": 4, "initial_replicas": 5}),
            "models[0].deployment_config.autoscaling_config.initial_replicas: "
            "must be an integer in [1, 4] (min_replicas, max_replicas) or null, got 5",
        ),
        (
            deployment(num_replicas=0),
            "models[0].deployment_config.num_replicas: must be an integer >= 1 or null, got 0",
        ),
        (
            deployment(max_queued_requests=-2),
            "models[0].deployment_config.max_queued_requests: "
            "must be an integer >= -1 (-1: unbounded), got -2",
        ),
        (
            deployment(prefix_router={"min_match_fraction": 1.5}),
            "models[0].deployment_config.prefix_router.min_match_fraction: "
            "must be a number in [0, 1], got 1.5",
        ),
        (
            deployment(max_ongoing_requests="many"),
            "models[0].deployment_config.max_ongoing_requests: must be an integer, got 'many'",
        ),
        (
            {**deployment(), "http_options": {"port": 70000}},
            "http_options.port: must be an integer in [0, 65535], got 70000",
        ),
    ],
)
def test_cluster_config_errors_name_the_key_path_range_and_value(
    data: dict[str, Any], message: str
) -> None:
    assert config_error(data) == message


def test_an_engine_argument_in_the_yaml_gets_the_engine_message_under_its_key_path() -> None:
    data = deployment()
    data["models"][0]["engine_kwargs"] = {"max_num_seqs": 0}
    assert config_error(data) == (
        "models[0].engine_kwargs.max_num_seqs: must be an integer >= 1, got 0"
    )
