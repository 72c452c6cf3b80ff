"""LLMEngine / LLM behaviour on the tiny Llama: prefix caching, seeds, aborts, bad input."""

from __future__ import annotations

import random

import pytest

from engine import LLM, ConfigError, InvalidRequestError, SamplingParams
from engine.core.request import RequestStatus

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, num_kv_blocks=512, max_model_len=1024)


def _ids(seed: int, n: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _finish(llm: LLM) -> None:
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


def test_second_request_reuses_cached_256_token_prefix(llm: LLM) -> None:
    prefix = _ids(1, 256)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    first = llm.generate({"prompt_token_ids": prefix + [5, 6]}, greedy, use_tqdm=False)[0]
    second_prompt = prefix + [9, 10, 11]
    second = llm.generate({"prompt_token_ids": second_prompt}, greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 240
    uncached = LLM(MODEL, num_kv_blocks=512, max_model_len=1024, enable_prefix_caching=False)
    expected = uncached.generate({"prompt_token_ids": second_prompt}, greedy, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert expected.num_cached_tokens == 0


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate({"prompt_token_ids": _ids(2, 40)}, seeded, use_tqdm=False)[0]
    others = [SamplingParams(temperature=0.8, max_tokens=30) for _ in range(5)]
    batch = llm.generate(
        [{"prompt_token_ids": _ids(10 + i, 20 + 13 * i)} for i in range(5)]
        + [{"prompt_token_ids": _ids(2, 40)}],
        [*others, seeded],
        use_tqdm=False,
    )
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_different_seeds_give_different_samples(llm: LLM) -> None:
    prompt = {"prompt_token_ids": _ids(3, 10)}
    a = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=24), use_tqdm=False)
    b = llm.generate(prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=24), use_tqdm=False)
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids


def test_outputs_come_back_in_input_order(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": _ids(i, 5 + 40 * (3 - i))} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=1 + 10 * i) for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 11, 21, 31]
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    out = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (5, "length")


def test_stop_string_ends_generation_and_is_excluded(llm: LLM) -> None:
    free = llm.generate(
        "The", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop = free.text[10:13]
    assert stop.strip(), "need a non-blank stop string from the free-running text"
    out = llm.generate(
        "The",
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    assert len(out.token_ids) < len(free.token_ids)


def test_stop_token_id_ends_generation(llm: LLM) -> None:
    free = llm.generate(
        "A", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    token = free.token_ids[5]
    out = llm.generate(
        "A",
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[token], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(token) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", token)


def test_the_stop_token_is_not_in_the_text(llm: LLM) -> None:
    """As in vLLM: the token that ended a request (one of ``stop_token_ids``, or EOS kept by
    ``skip_special_tokens=False``) is counted but not detokenized, unless
    ``include_stop_str_in_output``."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = llm.generate("A", greedy, use_tqdm=False)[0].outputs[0]
    token = next(t for t in free.token_ids[3:] if tok.decode([t]).strip())
    stopped = greedy.clone(stop_token_ids=[token])
    out = llm.generate("A", stopped, use_tqdm=False)[0].outputs[0]
    kept = llm.generate("A", stopped.clone(include_stop_str_in_output=True), use_tqdm=False)
    assert out.token_ids[-1] == token and kept[0].outputs[0].token_ids == out.token_ids
    assert out.text == tok.decode(out.token_ids[:-1])
    assert kept[0].outputs[0].text == tok.decode(out.token_ids)
    eos = SamplingParams(temperature=0, max_tokens=20, min_tokens=3, skip_special_tokens=False,
                         logit_bias={tok.eos_token_id: 100.0})  # fmt: skip
    ended = llm.generate("A", eos, use_tqdm=False)[0].outputs[0]
    assert (ended.finish_reason, ended.token_ids[-1]) == ("stop", tok.eos_token_id)
    assert ended.text == tok.decode(ended.token_ids[:-1]) and tok.eos_token not in ended.text


def test_abort_frees_blocks_and_worker_state(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request(
        "abort-me", {"prompt_token_ids": _ids(4, 100)}, SamplingParams(max_tokens=50)
    )
    engine.step()
    assert engine.get_kv_cache_stats().used > 0
    engine.abort_request("abort-me")
    engine.step()  # delivers the finished id to the workers
    engine.check_integrity()
    stats = engine.get_kv_cache_stats()
    assert stats.free == stats.total
    assert engine.executor.collective_rpc("num_request_states") == [0]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ({"prompt_token_ids": [1] * 1000}, SamplingParams(max_tokens=100), "max_tokens"),
        ({"prompt_token_ids": [1] * 1024}, SamplingParams(max_tokens=1), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1, 10**9]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [1, -1]}, SamplingParams(), "prompt_token_ids"),
        (42, SamplingParams(), "prompt"),
        ("hi", SamplingParams(n=129), "n"),  # max_n 128
        ("hi", SamplingParams(logprobs=21), "logprobs"),  # max_logprobs 20
        ("hi", SamplingParams(stop=[f"s{i}" for i in range(17)]), "stop"),  # max_stop_strings
        ("hi", SamplingParams(stop=["x" * 257]), "stop"),  # max_stop_str_len 256
    ],
)
def test_bad_request_is_rejected_and_others_keep_running(llm: LLM, prompt, params, field) -> None:
    engine = llm.llm_engine
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("good", {"prompt_token_ids": _ids(5, 12)}, good)
    engine.step()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.param == field
    assert field in str(info.value)
    assert "bad" not in engine.scheduler.requests
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 8
    engine.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"seed": "abc"}, "seed"),
    ],
)
def test_out_of_range_sampling_values_name_the_field(kwargs, field) -> None:
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field


def test_batch_with_one_invalid_prompt_enqueues_nothing(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()


def test_unknown_engine_argument_is_named() -> None:
    with pytest.raises(
        ConfigError, match="max_num_seq: unknown engine argument; did you mean 'max_num_seqs'"
    ):
        LLM(MODEL, max_num_seq=4)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"block_size": 12}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": 10**6}, "max_model_len"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"dtype": "float8"}, "dtype"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_stop_strings": 0}, "max_stop_strings"),
        ({"max_stop_str_len": -1}, "max_stop_str_len"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64}, "max_num_batched_tokens"),
    ],
)
def test_out_of_range_engine_values_name_the_key(kwargs, key) -> None:
    with pytest.raises(ConfigError, match=key):
        LLM(MODEL, **kwargs)


def test_unsupported_architecture_lists_supported(tmp_path) -> None:
    import json
    import shutil

    from engine.builtin.catalog import resolve_model_source

    src = resolve_model_source(MODEL)
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"'GPT2LMHeadModel' is not supported.*Qwen3ForCausalLM"):
        LLM(str(tmp_path / "m"))


def test_request_status_is_abort_after_abort(llm: LLM) -> None:
    engine = llm.llm_engine
    request = engine.add_request("x", "hi", SamplingParams(max_tokens=4))
    engine.abort_request("x")
    assert request.status is RequestStatus.FINISHED_ABORTED
    _finish(llm)


def test_token_prompt_ending_inside_a_character_is_not_echoed_in_the_text(llm: LLM) -> None:
    """Token-id prompts can end inside a UTF-8 character; the completion's text is what the
    generated tokens add to the prompt's decoded text, never the prompt itself."""
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello 日本", add_special_tokens=False)
    prompt = ids[:-1]
    assert tok.decode(prompt).endswith("\ufffd")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    full = tok.decode(prompt + list(out.token_ids))
    assert out.text == full[len(tok.decode(prompt)) :]
    assert not out.text.startswith("Hello")
