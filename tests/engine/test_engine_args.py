"""Engine argument names: an unknown one is refused with the closest name, a vLLM argument this
engine does not take with where its equivalent lives, a non-string key by its type."""

from __future__ import annotations

import pytest

from engine.engine_args import check_engine_arg_names
from engine.errors import ConfigError


def error_of(kwargs: dict[object, object]) -> str:
    with pytest.raises(ConfigError) as info:
        check_engine_arg_names(kwargs, path="engine_kwargs.")  # type: ignore[arg-type]
    return str(info.value)


@pytest.mark.parametrize(
    ("name", "pointer"),
    [
        ("enable_sleep_mode", "sleep_config"),
        ("served_model_name", "model_loading_config.model_id"),
        ("pooler_config", "pooling_type"),
        ("num_gpu_blocks_override", "num_kv_blocks"),
        ("revision", "model_source"),
    ],
)
def test_a_vllm_argument_not_taken_here_points_to_its_equivalent(name: str, pointer: str) -> None:
    error = error_of({name: 1})
    assert error.startswith(f"engine_kwargs.{name}: vLLM's engine argument, not supported")
    assert pointer in error.partition("; use ")[2]
    assert "did you mean" not in error


def test_a_vllm_argument_without_an_equivalent_gets_no_misleading_suggestion() -> None:
    assert error_of({"async_scheduling": True}) == (
        "engine_kwargs.async_scheduling: vLLM's engine argument, not supported by this engine"
    )


def test_a_typo_still_gets_the_closest_name() -> None:
    assert error_of({"max_model_length": 1}) == (
        "engine_kwargs.max_model_length: unknown engine argument; did you mean 'max_model_len'?"
    )


def test_a_key_that_is_not_a_string_is_refused_by_its_type() -> None:
    assert error_of({1: 2}) == "engine_kwargs.1: engine argument names must be strings, got int 1"
    assert "unquoted on/off/yes/no" in error_of({True: 2})
