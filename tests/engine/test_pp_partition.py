"""Pipeline stages (``engine.pp_partition``): the balanced default, which gives the last stage
(LM head, sampling) fewer layers; ``pp_layer_partition`` and ``VLLM_PP_LAYER_PARTITION``."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from engine import ConfigError, EngineConfig
from engine.pp_partition import (
    balanced_partition,
    default_partition,
    lm_head_layers,
    mlp_macs,
    stage_layer_range,
)

# cluster bench throughput's built-in random Llama (the BENCHMARKS "Pipelined PP" model).
BENCH_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 1536,
    "vocab_size": 32000,
}
LLAMA_3_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
}


def test_without_extra_work_the_split_is_even_with_earlier_stages_taking_the_remainder() -> None:
    assert balanced_partition(12, 2, 0.0) == (6, 6)
    assert balanced_partition(13, 2, 0.0) == (7, 6)
    assert balanced_partition(10, 3, 0.0) == (4, 3, 3)


def test_the_last_stage_gives_up_layers_for_its_extra_work() -> None:
    assert balanced_partition(12, 2, 2.0) == (7, 5)
    assert balanced_partition(12, 3, 2.0) == (5, 5, 2)


def test_every_stage_keeps_at_least_one_layer() -> None:
    assert balanced_partition(2, 2, 10.0) == (1, 1)
    assert balanced_partition(4, 4, 10.0) == (1, 1, 1, 1)


@pytest.mark.parametrize("extra", [0.0, 0.4, 1.0, 1.7, 3.2, 6.0])
@pytest.mark.parametrize(("num_layers", "pp"), [(5, 2), (9, 2), (8, 3), (10, 4)])
def test_no_split_has_a_faster_slowest_stage(num_layers: int, pp: int, extra: float) -> None:
    def slowest(stages: tuple[int, ...]) -> float:
        return max(*stages[:-1], stages[-1] + extra)

    every = [
        s for s in itertools.product(range(1, num_layers + 1), repeat=pp) if sum(s) == num_layers
    ]
    chosen = balanced_partition(num_layers, pp, extra)
    assert sum(chosen) == num_layers and min(chosen) >= 1
    assert slowest(chosen) == min(slowest(s) for s in every)


def test_one_stage_holds_every_layer() -> None:
    assert default_partition(BENCH_LLAMA, 1) == (12,)


def test_bench_llama_gives_its_last_stage_the_lm_head_and_fewer_layers() -> None:
    # LM head 32000 x 768 against a layer's 1.57 M (attention) + 3.54 M (MLP) multiply-adds.
    assert lm_head_layers(BENCH_LLAMA) == pytest.approx(4.81, abs=0.01)
    assert default_partition(BENCH_LLAMA, 2) == (8, 4)  # stage costs 8 and 8.8 layers
    assert default_partition(BENCH_LLAMA, 3) == (6, 5, 1)


def test_llama_70b_head_is_about_a_layer_and_a_quarter_of_multiply_adds() -> None:
    assert lm_head_layers(LLAMA_3_70B) == pytest.approx(1.23, abs=0.01)
    assert default_partition(LLAMA_3_70B, 2) == (41, 39)


def test_no_stage_takes_on_more_layers_than_weigh_as_much_as_the_lm_head() -> None:
    # 12 layers of 64 experts (top-2): the head is ~2.6 layers of compute but weighs less than
    # one layer with all its experts, so the split stays even.
    moe = _bench_moe(num_experts=64, top_k=2, expert_size=768)
    assert lm_head_layers(moe) > 2
    assert default_partition(moe, 2) == (6, 6)
    assert balanced_partition(12, 2, 4.8, head_room=1) == (7, 5)


def test_a_tied_head_costs_the_same_as_an_untied_one() -> None:
    tied = {**BENCH_LLAMA, "tie_word_embeddings": True}
    assert lm_head_layers(tied) == lm_head_layers(BENCH_LLAMA)


def test_a_sparse_layer_counts_the_router_and_the_experts_a_token_goes_through() -> None:
    moe = _bench_moe(num_experts=16, top_k=4, expert_size=512)
    assert mlp_macs(moe, 0) == 768 * 16 + 4 * 3 * 768 * 512


def test_stage_ranges_follow_the_partition() -> None:
    assert [stage_layer_range((41, 39), r) for r in range(2)] == [(0, 41), (41, 80)]


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
        ([1, 2], "must list 2 positive .* summing to num_hidden_layers \\(2\\)"),
    ],
)
def test_bad_partition_names_the_key(partition: list[int], message: str) -> None:
    with pytest.raises(ConfigError, match=f"pp_layer_partition: {message}"):
        EngineConfig.from_kwargs(
            model="builtin:tiny-llama", pipeline_parallel_size=2, pp_layer_partition=partition
        )


def test_vllm_variable_sets_the_partition_when_the_argument_is_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2, 1")
    config = EngineConfig.from_kwargs(model="builtin:tiny-gemma2", pipeline_parallel_size=2)
    assert config.parallel.pp_layer_partition == (2, 1)


def test_the_engine_argument_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,1")
    config = EngineConfig.from_kwargs(
        model="builtin:tiny-gemma2", pipeline_parallel_size=2, pp_layer_partition=[1, 2]
    )
    assert config.parallel.pp_layer_partition == (1, 2)


def test_the_variable_is_not_read_with_one_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,1")
    config = EngineConfig.from_kwargs(model="builtin:tiny-gemma2")
    assert config.parallel.pp_layer_partition is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2;1", "must be positive layer counts separated by commas, one per pipeline stage "
         "\\(e.g. '7,5'\\), got '2;1'"),
        ("2,0", "must be positive layer counts"),
        ("2,-1", "must be positive layer counts"),
        ("1,1", "must list 2 positive layer counts \\(one per pipeline stage\\) summing to "
         "num_hidden_layers \\(3\\), got \\[1, 1\\]"),
        ("1,1,1", "must list 2 positive layer counts"),
    ],
)  # fmt: skip
def test_a_bad_variable_is_refused_by_its_name(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", value)
    with pytest.raises(ConfigError, match=f"VLLM_PP_LAYER_PARTITION: {message}"):
        EngineConfig.from_kwargs(model="builtin:tiny-gemma2", pipeline_parallel_size=2)


def _bench_moe(num_experts: int, top_k: int, expert_size: int) -> dict:
    """The bench Llama's shape with every layer sparse (Qwen3-MoE)."""
    return {
        **BENCH_LLAMA,
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_size,
    }
