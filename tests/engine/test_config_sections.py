"""The engine's config sections check their own fields' types: a boolean argument is true or
false, never a truthy string or number (``"false"`` would turn the feature on)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import check_engine_arg_ranges
from engine.engine_args import ENGINE_ARGS, NULL_IS_DEFAULT
from engine.errors import ConfigError

BOOLEAN_ARGS = ("enable_prefix_caching", "enable_chunked_prefill", "disable_chunked_mm_input",
                "enable_expert_parallel", "enforce_eager", "enable_auto_tool_choice",
                "enable_lora", "enable_prompt_tokens_details")  # fmt: skip


# null is refused too, except where it is vLLM's default (NULL_IS_DEFAULT: test_validation).
NOT_BOOLEANS = [
    (name, value)
    for name in BOOLEAN_ARGS
    for value in ("false", 1, None)
    if value is not None or name not in NULL_IS_DEFAULT
]


@pytest.mark.parametrize(("name", "value"), NOT_BOOLEANS)
def test_a_boolean_engine_argument_must_be_true_or_false(name: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        check_engine_arg_ranges({name: value})
    assert str(info.value) == f"{name}: must be true or false, got {value!r}"


@pytest.mark.parametrize("name", BOOLEAN_ARGS)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_engine_argument_takes_a_bool(name: str, value: bool) -> None:
    check_engine_arg_ranges({name: value})


def test_every_boolean_engine_argument_is_checked() -> None:
    """A new bool field of a section is added here (and checked in its ``__post_init__``)."""
    import dataclasses
    import typing

    from engine import config as engine_config

    sections = {f.name: f.type for f in dataclasses.fields(engine_config.EngineConfig)}
    hints = typing.get_type_hints(engine_config.EngineConfig)
    booleans = set()
    for arg, (section, field_name) in ENGINE_ARGS.items():
        assert section in sections
        field_hints = typing.get_type_hints(hints[section])
        if field_hints.get(field_name) is bool:
            booleans.add(arg)
    booleans.discard("trust_remote_code")  # must be false: its own check and message
    assert booleans == set(BOOLEAN_ARGS)


def test_pp_layer_partition_must_be_a_list() -> None:
    with pytest.raises(ConfigError, match=r"^pp_layer_partition: must list 2 .* got '7,5'$"):
        check_engine_arg_ranges({"pipeline_parallel_size": 2, "pp_layer_partition": "7,5"})


@pytest.mark.parametrize(
    ("sizes", "workers"),
    [({"tensor_parallel_size": 2}, "2 x pipeline_parallel_size 1 x data_parallel_size 1 = 2"),
     ({"pipeline_parallel_size": 2}, "1 x pipeline_parallel_size 2 x data_parallel_size 1 = 2")],
)  # fmt: skip
def test_the_in_process_executor_refuses_more_than_one_worker(
    sizes: dict[str, int], workers: str
) -> None:
    """'uni' runs the one worker in the head's process: a TP or PP size would be dropped."""
    with pytest.raises(ConfigError) as info:
        check_engine_arg_ranges({**sizes, "distributed_executor_backend": "uni"})
    assert str(info.value) == (
        "distributed_executor_backend: 'uni' runs one worker in the head's process; "
        f"tensor_parallel_size {workers} workers needs 'ray' (or 'auto')"
    )


@pytest.mark.parametrize("backend", ["auto", "ray"])
def test_a_multi_worker_engine_takes_the_ray_or_auto_executor(backend: str) -> None:
    check_engine_arg_ranges({"tensor_parallel_size": 2, "distributed_executor_backend": backend})
