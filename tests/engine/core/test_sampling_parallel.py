"""Parallel sampling (n > 1): the prompt's KV blocks are shared by the n samples, forks are
exact, seeds give distinct but reproducible samples, and aborting frees everything."""

from __future__ import annotations

import random

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.worker.step_messages import ExecuteModelRequest

MODEL = "builtin:tiny-llama"
BS = 16


def _ids(seed: int, n: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, num_kv_blocks=256, max_model_len=512)


def _record_messages(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list:
    sent: list[ExecuteModelRequest] = []
    execute = engine.executor.execute_model

    def recording(request: ExecuteModelRequest):
        sent.append(request)
        return execute(request)

    monkeypatch.setattr(engine.executor, "execute_model", recording)
    return sent


def _assert_all_free(engine: LLMEngine) -> None:
    engine.check_integrity()
    stats = engine.get_kv_cache_stats()
    assert stats.used == 0 and stats.free == stats.total
    assert engine.executor.collective_rpc("num_request_states") == [0]


def test_eight_samples_share_the_200_token_prompt_blocks(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, n, prompt_len, max_tokens = llm.llm_engine, 8, 200, 20
    sent = _record_messages(engine, monkeypatch)
    params = SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("shared", {"prompt_token_ids": _ids(1, prompt_len)}, params)
    prompt_blocks = -(-prompt_len // BS)  # 13
    engine.step()  # sample 0 computes the prompt once; the others fork from it
    assert sent[0].num_scheduled_tokens == {"shared": prompt_len}
    assert engine.get_kv_cache_stats().used == prompt_blocks
    tables = [
        engine.block_manager.get_block_ids(f"{i}_shared" if i else "shared") for i in range(n)
    ]
    assert all(t == tables[0] for t in tables)  # 13 blocks, each held 8 times
    engine.step()  # sample 0 decodes, samples 1..7 recompute only the last prompt token
    assert set(sent[1].num_scheduled_tokens.values()) == {1}
    # Blocks of tokens 0..191 stay shared; the partial block 12 was copied on write by all but
    # its last writer.
    assert len(sent[1].blocks_to_copy) == n - 1
    tables = [
        engine.block_manager.get_block_ids(f"{i}_shared" if i else "shared") for i in range(n)
    ]
    assert all(t[:12] == tables[0][:12] for t in tables)
    assert len({t[12] for t in tables}) == n
    assert engine.get_kv_cache_stats().used == prompt_blocks + n - 1
    peak, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        peak = max(peak, engine.get_kv_cache_stats().used)
    # Own output blocks: tokens past the prompt's last block (208) need one more block each.
    own = n * -(-(prompt_len + max_tokens - prompt_blocks * BS) // BS)
    assert peak <= prompt_blocks + n + own < n * prompt_blocks
    assert outputs[0].finished and [len(o.token_ids) for o in outputs[0].outputs] == [20] * n
    _assert_all_free(engine)


@pytest.mark.parametrize("prompt_len", [1, 16, 17, 40])
def test_greedy_samples_all_equal_the_single_greedy_output(llm: LLM, prompt_len: int) -> None:
    # Forked samples recompute the last prompt token on shared / copied blocks: any mistake in
    # the block table or the copy changes their tokens. 16 and 17 put the last prompt token at
    # the end / start of a block.
    prompt = {"prompt_token_ids": _ids(prompt_len, prompt_len)}
    single = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = llm.generate(prompt, single, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate(prompt, single.clone(n=3), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.token_ids for o in out.outputs] == [expected] * 3
    _assert_all_free(llm.llm_engine)


def test_forked_samples_survive_preemption() -> None:
    # 12 blocks for 4 samples of 60 + 40 tokens: they cannot all fit, so some are preempted.
    llm = LLM(MODEL, num_kv_blocks=12, max_model_len=128)
    prompt = {"prompt_token_ids": _ids(9, 60)}
    single = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = llm.generate(prompt, single, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate(prompt, single.clone(n=4), use_tqdm=False)[0]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out.outputs] == [expected] * 4
    _assert_all_free(llm.llm_engine)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int], n: int) -> list[list]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=n) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forked_samples_of_several_prompts_survive_preemption(llm: LLM, mode: str) -> None:
    """15 blocks for 3 samples of each of 5 prompts: samples are preempted while others
    copy-on-write, so a block swapped out is given to a copy in the same step (the workers
    must swap it out before they copy into it), and a sample that copied is swapped out in
    the step of its copy (its swap-out must read the copy's source)."""
    prompts = [_ids(20 + n, n) for n in (2, 43, 13, 70, 1)]
    max_tokens = [29] * len(prompts)
    expected = [[single[0]] * 3 for single in _greedy(llm, prompts, max_tokens, 1)]
    tight = LLM(MODEL, num_kv_blocks=15, max_model_len=256, preemption_mode=mode,
                swap_space=0.01)  # fmt: skip
    assert _greedy(tight, prompts, max_tokens, 3) == expected
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert (tight.llm_engine.scheduler.num_swap_outs > 0) == (mode == "swap")
    _assert_all_free(tight.llm_engine)


def test_a_sample_forked_and_preempted_in_one_step(llm: LLM) -> None:
    """A sample scheduled for the first time (new to the workers) and preempted later in the
    same step is taken back out of the step like any other."""
    rng = random.Random(1085)
    lengths = [2, 16, 4, 2, 2, 1, 1, 16, 17, 17, 10, 90]
    max_tokens = [5, 5, 1, 40, 5, 5, 5, 5, 11, 7, 40, 5]
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in lengths]
    tight = LLM(MODEL, num_kv_blocks=13, max_model_len=256, max_num_seqs=16)
    for a, b in ((0, 6), (6, 12)):
        expected = [[single[0]] * 3 for single in _greedy(llm, prompts[a:b], max_tokens[a:b], 1)]
        assert _greedy(tight, prompts[a:b], max_tokens[a:b], 3) == expected
    assert tight.llm_engine.scheduler.num_preemptions > 0
    _assert_all_free(tight.llm_engine)


def test_seeded_samples_differ_from_each_other_and_reproduce(llm: LLM) -> None:
    prompt = {"prompt_token_ids": _ids(2, 30)}
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in first}) == 4
    others = [SamplingParams(temperature=0.7, max_tokens=12 + i) for i in range(3)]
    batch = llm.generate(
        [{"prompt_token_ids": _ids(20 + i, 10 + 9 * i)} for i in range(3)] + [prompt],
        [*others, params],
        use_tqdm=False,
    )
    assert [o.token_ids for o in batch[-1].outputs] == first


@pytest.mark.parametrize("steps_before_abort", [2, 6])
def test_aborting_the_request_aborts_every_sample_and_frees_every_block(
    steps_before_abort: int,
) -> None:
    # 64-token steps: after 2 steps the 200-token prompt is mid-prefill (samples 1..3 wait to
    # fork); after 6 they have forked and decode.
    llm = LLM(MODEL, num_kv_blocks=64, max_num_batched_tokens=64)
    engine = llm.llm_engine
    params = SamplingParams(n=4, temperature=1.0, max_tokens=50, ignore_eos=True)
    engine.add_request("parent", {"prompt_token_ids": _ids(5, 200)}, params)
    for _ in range(steps_before_abort):
        engine.step()
    assert engine.get_kv_cache_stats().used > 0
    forked = not engine.scheduler.pending_forks
    assert forked == (steps_before_abort == 6)
    engine.abort_request("parent")
    assert not engine.has_unfinished_requests()
    engine.step()  # delivers the finished ids to the workers
    _assert_all_free(engine)
