"""``speculative_config`` validation and the n-gram proposer, without a model."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig, check_engine_arg_ranges
from engine.core.request import Request
from engine.errors import ConfigError
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramIndex, NgramProposer


def spec(**kw):
    return {"method": "ngram", "num_speculative_tokens": 3, **kw}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (spec(num_speculative_tokens=0), "speculative_config.num_speculative_tokens: must be an "
         "integer in [1, 16], got 0"),
        (spec(num_speculative_tokens=17), "in [1, 16], got 17"),
        (spec(num_speculative_tokens=True), "got True"),
        ({"method": "ngram"}, "num_speculative_tokens: must be an integer in [1, 16] (it has "
         "no default), got None"),
        (spec(method="draft_model"), "speculative_config.model: must name the draft checkpoint"),
        (spec(method="eagle"), "speculative_config.method: must be one of 'ngram', "
         "'draft_model' ('eagle' is not supported by this engine)"),
        (spec(method="medusa2"), "speculative_config.method: must be one of 'ngram', "
         "'draft_model', got"),
        (spec(prompt_lookup_min=0), "speculative_config.prompt_lookup_min: must be an integer "
         "in [1, 32] or null, got 0"),
        (spec(prompt_lookup_min=4, prompt_lookup_max=2), "speculative_config.prompt_lookup_max: "
         "must be an integer in [4, 32] (prompt_lookup_min), got 2"),
        (spec(prompt_lookup_max=40), "speculative_config.prompt_lookup_max: must be an integer "
         "in [1, 32] or null, got 40"),
        (spec(prompt_lookup_min=33), "speculative_config.prompt_lookup_min: must be an integer "
         "in [1, 32] or null, got 33"),
        ({"num_speculative_tokens": 3}, "speculative_config.method: must be one of 'ngram', "
         "'draft_model' when speculative_config.model is not given"),
        ({"method": None, "num_speculative_tokens": 3}, "speculative_config.method: must be one "
         "of 'ngram', 'draft_model' when speculative_config.model is not given"),
        (spec(quantization="fp8"), "speculative_config.quantization: must be null (a draft is "
         "served unquantized"),
        (spec(revision="main"), "speculative_config.revision: must be null (nothing is fetched"),
        (spec(enforce_eager=False), "speculative_config.enforce_eager: must be null or true (the "
         "draft's passes always run eagerly"),
        (spec(draft_tensor_parallel_size=0), "speculative_config.draft_tensor_parallel_size: "
         "must be an integer >= 1 or null, got 0"),
        ({**spec(), "num-speculative-tokens": 2}, "speculative_config.num_speculative_tokens: is "
         "given twice"),
        (spec(code_revision="x"), "speculative_config.code_revision: must be one of the keys"),
        (spec(model="/some/draft"), "speculative_config.model: must be null for method 'ngram'"),
        (spec(num_lookahead=2), "speculative_config.num_lookahead: must be one of the keys"),
        ("ngram", "speculative_config: must be a mapping"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(value, message):
    with pytest.raises(ConfigError) as info:
        check_engine_arg_ranges({"speculative_config": value})
    assert message in str(info.value)


def test_vllm_defaults_and_one_sided_lookup_bounds():
    assert SpeculativeConfig.from_arg(spec()).prompt_lookup_min == 5
    assert SpeculativeConfig.from_arg(spec()).prompt_lookup_max == 5
    assert SpeculativeConfig.from_arg(spec(prompt_lookup_max=3)).prompt_lookup_min == 3
    assert SpeculativeConfig.from_arg(spec(prompt_lookup_min=2)).prompt_lookup_max == 2
    assert SpeculativeConfig.from_arg(None) is None


def test_null_values_are_unset():
    unset = ("prompt_lookup_min", "prompt_lookup_max", "model", "draft_tensor_parallel_size",
             "max_model_len", "quantization", "revision", "enforce_eager")  # fmt: skip
    nulls = spec(**dict.fromkeys(unset))
    assert SpeculativeConfig.from_arg(nulls) == SpeculativeConfig(prompt_lookup_min=5)
    inferred = SpeculativeConfig.from_arg(
        {"method": None, "model": "/d", "num_speculative_tokens": 3}
    )
    assert inferred == SpeculativeConfig(method="draft_model", model="/d")


def test_hyphenated_keys_read_as_underscores():
    hyphens = {"method": "ngram", "num-speculative-tokens": 2, "prompt-lookup-max": 3}
    assert SpeculativeConfig.from_arg(hyphens) == SpeculativeConfig(
        num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=3
    )


def test_prompt_lookup_max_up_to_32_is_accepted():
    config = SpeculativeConfig.from_arg(spec(prompt_lookup_max=32))
    assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == (32, 32)


@pytest.mark.parametrize(
    ("settings", "parallel"),
    [
        ({"draft_tensor_parallel_size": 1}, {}),
        ({"draft_tensor_parallel_size": 2}, {"tensor_parallel_size": 2}),
        ({"max_model_len": 512}, {"max_model_len": 512}),
        ({"quantization": None, "revision": None, "enforce_eager": True}, {}),
    ],
)
def test_vllm_draft_settings_naming_the_served_values_are_accepted(settings, parallel):
    check_engine_arg_ranges({**parallel, "speculative_config": spec(**settings)})


@pytest.mark.parametrize(
    ("settings", "parallel", "message"),
    [
        ({"draft_tensor_parallel_size": 1}, {"tensor_parallel_size": 2},
         "speculative_config.draft_tensor_parallel_size: must be null or 2 (tensor_parallel_size: "
         "a draft is sharded like the target, on the same ranks), got 1"),
        ({"max_model_len": 256}, {"max_model_len": 512},
         "speculative_config.max_model_len: must be null or 512 (the target's max_model_len"),
        ({"max_model_len": 1024}, {"max_model_len": 512},
         "speculative_config.max_model_len: must be null or 512"),
    ],
)  # fmt: skip
def test_vllm_draft_settings_the_engine_does_not_serve_are_refused(settings, parallel, message):
    with pytest.raises(ConfigError) as info:
        check_engine_arg_ranges({**parallel, "speculative_config": spec(**settings)})
    assert message in str(info.value)


def test_draft_max_model_len_is_checked_against_the_derived_target_length():
    # builtin:tiny-llama's max_model_len comes from its checkpoint, not from an argument.
    config = EngineConfig.from_kwargs(model="builtin:tiny-llama", device="cpu")
    length = config.max_model_len
    with pytest.raises(ConfigError, match=rf"speculative_config\.max_model_len: must be null or "
                       rf"{length} "):  # fmt: skip
        EngineConfig.from_kwargs(
            model="builtin:tiny-llama",
            device="cpu",
            speculative_config=spec(max_model_len=length // 2),
        )
    EngineConfig.from_kwargs(
        model="builtin:tiny-llama", device="cpu", speculative_config=spec(max_model_len=length)
    )


def test_draft_with_a_sliding_window_the_target_lacks_is_refused():
    # Its layers' KV would belong to no KV cache group of the target (the worker would fail).
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(
            model="builtin:tiny-llama", device="cpu", max_model_len=256,
            speculative_config={"model": "builtin:tiny-gemma2", "num_speculative_tokens": 3},
        )  # fmt: skip
    message = str(info.value)
    assert message.startswith("speculative_config.model: the draft 'builtin:tiny-gemma2' has ")
    assert "sliding_window 24" in message and "the target has full attention" in message


def test_pipeline_parallel_is_refused_by_name():
    with pytest.raises(ConfigError, match="speculative_config: needs pipeline_parallel_size 1"):
        EngineConfig.from_kwargs(
            model="builtin:tiny-llama", device="cpu", pipeline_parallel_size=2,
            speculative_config=spec(),
        )  # fmt: skip


def test_pipeline_parallel_is_refused_in_a_deployment_check():
    # The deployment YAML's check reads no checkpoint: the combination is refused there too.
    with pytest.raises(ConfigError, match="speculative_config: needs pipeline_parallel_size 1"):
        check_engine_arg_ranges({"pipeline_parallel_size": 2, "speculative_config": spec()})


def brute_force(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition: the latest earlier match of the longest suffix, continued periodically."""
    length = len(tokens)
    for n in range(min(n_max, length), n_min - 1, -1):
        suffix = tokens[length - n :]
        for t in range(length - 2, n - 2, -1):
            if tokens[t - n + 1 : t + 1] == suffix:
                out = []
                for i in range(k):
                    j = t + 1 + i
                    out.append(tokens[j] if j < length else out[i - (length - 1 - t)])
                return out
    return []


def test_incremental_index_matches_the_definition_at_every_length():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        index = NgramIndex(1, 3)
        seq: list[int] = []
        for token in tokens:
            seq.append(token)
            assert index.propose(seq, 4) == brute_force(seq, 4, 1, 3), (trial, seq)


def test_index_grows_only_over_new_tokens():
    index = NgramIndex(2, 2)
    seq = [1, 2, 3, 1, 2]
    assert index.propose(seq, 3) == [3, 1, 2]
    assert index.num_indexed == 4
    seq += [3, 1]
    assert index.propose(seq, 2) == [2, 3]
    assert index.num_indexed == 6  # the two new positions, not a rescan


def test_proposer_never_proposes_past_max_tokens():
    config = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=2)
    proposer = NgramProposer(config, max_model_len=100)
    request = Request("r", [4, 5, 4, 5, 4], SamplingParams(max_tokens=4), max_tokens=4)
    request.append_output_token_ids([5, 4])
    # 2 of 4 outputs left: one verified position plus at most one proposal.
    assert proposer.propose(request) == [5]
    request.append_output_token_ids([5])
    assert proposer.propose(request) == []
