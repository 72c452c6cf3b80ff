"""Pipeline stages: even split by default, an explicit per-stage layer count when given."""

from __future__ import annotations

import pytest

from engine import ConfigError, EngineConfig
from engine.models.decoder import pp_layer_range


def test_even_split_gives_earlier_stages_the_remainder() -> None:
    assert [pp_layer_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_explicit_partition_sets_each_stage_range() -> None:
    ranges = [pp_layer_range(80, r, 2, (41, 39)) for r in range(2)]
    assert ranges == [(0, 41), (41, 80)]


def test_partition_is_accepted_as_a_list_and_kept_as_a_tuple() -> None:
    config = EngineConfig.from_kwargs(
        model="builtin:tiny-llama", pipeline_parallel_size=2, pp_layer_partition=[1, 1]
    )
    assert config.parallel.pp_layer_partition == (1, 1)


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        ([2], "must list 2 positive layer counts"),
        ([2, 0], "must list 2 positive"),
        ([1, 2], "must sum to num_hidden_layers \\(2\\)"),
    ],
)
def test_bad_partition_names_the_key(partition: list[int], message: str) -> None:
    with pytest.raises(ConfigError, match=f"pp_layer_partition: {message}"):
        EngineConfig.from_kwargs(
            model="builtin:tiny-llama", pipeline_parallel_size=2, pp_layer_partition=partition
        )
