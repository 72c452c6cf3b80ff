"""``kv_transfer_config`` with ``NixlConnector``: a prefill engine (kv_producer) holds a finished
request's prompt blocks and names them in its output's ``kv_transfer_params``; a decode engine
(kv_consumer) given those params reads the blocks with NIXL (UCX, CPU memory) and computes only
the tail, token-equal to an engine without the connector (fp32, greedy); the prefill engine
releases the blocks once read, or after ``abort_request_timeout_s``; a prefill engine gone, a
read that outlasts ``transfer_timeout_s`` or a handle too old is recomputed with the same
tokens; n = 2 with logprobs; a decode worker of any TP size reads each KV head from the
prefill rank holding it; the configuration's refusals."""

from __future__ import annotations

import gc
import random
import time
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.kv_transfer.nixl import NixlScheduler
from engine.kv_transfer.nixl_worker import NixlWorkerTransfer
from engine.kv_transfer.store import kv_head_count

pytestmark = pytest.mark.nixl  # skipped, with the reason, where NIXL cannot be imported
ARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}
BLOCK = 16
# Full prompt blocks read: 6, 4 and 2 (the last token of a prompt is always computed).
LENGTHS = (100, 70, 33)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PREFILL = SamplingParams(
    temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
)


def _prompts(seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(n)]} for n in LENGTHS]


def _nixl(role: str, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": role}
    if extra:
        config["kv_connector_extra_config"] = extra
    return {"kv_transfer_config": config}


def _decode_params(params: dict[str, Any] | None, n: int = 1) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, n=n,
        extra_args={"kv_transfer_params": params},
    )  # fmt: skip


def _connector(llm: LLM) -> NixlScheduler:
    kv = llm.llm_engine.scheduler.kv_transfer
    assert isinstance(kv, NixlScheduler)
    return kv


def _drain(llm: LLM, timeout_s: float = 10.0) -> None:
    """Step an engine until nothing is left (held blocks included)."""
    engine = llm.llm_engine
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()


def _idle(llm: LLM) -> None:
    llm.llm_engine.check_integrity()
    sizes = llm.llm_engine.request_state_sizes()
    assert not any(sizes.values()), sizes
    assert llm.llm_engine.get_kv_cache_stats().used == 0


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM("builtin:tiny-llama", **ARGS)


@pytest.fixture
def expected(reference: LLM, request: pytest.FixtureRequest) -> list[list[int]]:
    """The greedy tokens of this test's prompts (a seed per test: the decode engine, shared by
    the tests, must not find them in its device prefix cache)."""
    prompts = _prompts(_seed(request))
    return [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]


def _seed(request: pytest.FixtureRequest) -> int:
    return sum(map(ord, request.node.name))


@pytest.fixture(scope="module")
def decode() -> LLM:
    return LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_consumer"))


def test_decode_engine_reads_the_prefill_blocks_computes_the_tail_and_matches(
    expected: list[list[int]], decode: LLM, request: pytest.FixtureRequest
) -> None:
    prompts = _prompts(_seed(request))
    prefill = LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_producer"))
    finished = prefill.generate(prompts, PREFILL, use_tqdm=False)
    params = [o.kv_transfer_params for o in finished]
    assert [len(p["remote_block_ids"]) for p in params] == [n // BLOCK for n in LENGTHS]
    assert _connector(prefill).num_held == 3  # nothing freed before the read
    before = _connector(decode).hit_tokens
    outputs = decode.generate(prompts, [_decode_params(p) for p in params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    full_blocks = [(n - 1) // BLOCK for n in LENGTHS]
    assert _connector(decode).hit_tokens - before == sum(full_blocks) * BLOCK
    # Computed only the tail: the read blocks count as cached prompt tokens.
    assert [o.num_cached_tokens for o in outputs] == [b * BLOCK for b in full_blocks]
    _drain(prefill)
    assert _connector(prefill).released_read == 3
    _idle(prefill)
    _idle(decode)


def test_blocks_not_read_are_released_after_abort_request_timeout_s(
    expected: list[list[int]], decode: LLM, request: pytest.FixtureRequest
) -> None:
    prompts = _prompts(_seed(request))
    prefill = LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_producer", abort_request_timeout_s=0.5))
    params = [o.kv_transfer_params for o in prefill.generate(prompts, PREFILL, use_tqdm=False)]
    assert _connector(prefill).num_held == 3
    _drain(prefill)
    assert _connector(prefill).released_timeout == 3
    _idle(prefill)
    # A handle past half the prefill's timeout is never read (its blocks may be reused).
    before = _connector(decode).hit_tokens
    outputs = decode.generate(prompts, [_decode_params(p) for p in params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert _connector(decode).hit_tokens == before
    _idle(decode)


def test_a_prefill_engine_gone_is_recomputed_with_the_same_tokens(
    expected: list[list[int]], decode: LLM, request: pytest.FixtureRequest
) -> None:
    prompts = _prompts(_seed(request))
    prefill = LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_producer"))
    params = [o.kv_transfer_params for o in prefill.generate(prompts, PREFILL, use_tqdm=False)]
    prefill.llm_engine.shutdown()
    del prefill
    gc.collect()  # its agents go with it
    failed = _connector(decode).failed_tokens
    outputs = decode.generate(prompts, [_decode_params(p) for p in params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    full_blocks = [(n - 1) // BLOCK for n in LENGTHS]
    assert _connector(decode).failed_tokens - failed == sum(full_blocks) * BLOCK
    _idle(decode)


def test_a_read_that_outlasts_transfer_timeout_s_is_recomputed_with_the_same_tokens(
    expected: list[list[int]], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _prompts(_seed(request))
    decode = LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_consumer", transfer_timeout_s=0.2))
    worker = decode.llm_engine.executor.worker.runner.kv_transfer  # type: ignore[attr-defined]
    assert isinstance(worker, NixlWorkerTransfer)
    # The reads never report done (a stalled network): the worker gives up at the timeout.
    monkeypatch.setattr(worker.agent, "check_xfer_state", lambda handle: "PROC")
    prefill = LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_producer"))
    params = [o.kv_transfer_params for o in prefill.generate(prompts, PREFILL, use_tqdm=False)]
    started = time.monotonic()
    outputs = decode.generate(prompts, [_decode_params(p) for p in params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert time.monotonic() - started >= 0.2
    full_blocks = [(n - 1) // BLOCK for n in LENGTHS]
    assert _connector(decode).failed_tokens == sum(full_blocks) * BLOCK
    assert _connector(decode).hit_tokens == 0
    _drain(prefill)  # the decode side notified the prefill all the same
    assert _connector(prefill).released_read == 3
    _idle(prefill)
    _idle(decode)


def test_n_samples_and_logprobs_fork_from_the_read_prompt(
    reference: LLM, decode: LLM, request: pytest.FixtureRequest
) -> None:
    prompt = _prompts(_seed(request))[:1]
    sampled: dict[str, Any] = {
        "temperature": 0.8,
        "seed": 7,
        "n": 2,
        "max_tokens": 6,
        "logprobs": 2,
    }
    want = reference.generate(prompt, SamplingParams(**sampled), use_tqdm=False)[0]
    prefill = LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_producer"))
    params = prefill.generate(prompt, PREFILL, use_tqdm=False)[0].kv_transfer_params
    extra = {"kv_transfer_params": params}
    got = decode.generate(prompt, SamplingParams(**sampled, extra_args=extra), use_tqdm=False)
    assert [c.token_ids for c in got[0].outputs] == [c.token_ids for c in want.outputs]
    for a, b in zip(got[0].outputs, want.outputs, strict=True):
        assert [sorted(x) for x in a.logprobs] == [sorted(x) for x in b.logprobs]
    assert got[0].num_cached_tokens == (LENGTHS[0] - 1) // BLOCK * BLOCK
    _drain(prefill)
    _idle(prefill)


def test_a_request_without_remote_decode_frees_its_blocks_at_once() -> None:
    prefill = LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_both"))
    outputs = prefill.generate(_prompts(), GREEDY, use_tqdm=False)
    assert all(o.kv_transfer_params is None for o in outputs)
    assert not prefill.llm_engine.has_unfinished_requests()
    _idle(prefill)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"shared_storage_path": "/tmp/x"}, "kv_connector_extra_config.shared_storage_path"),
        ({"abort_request_timeout_s": 0}, "kv_connector_extra_config.abort_request_timeout_s"),
        ({"transfer_timeout_s": -1}, "kv_connector_extra_config.transfer_timeout_s"),
    ],
)
def test_nixl_connector_refuses_other_keys_and_bad_timeouts_by_key_path(
    extra: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError, match=f"kv_transfer_config.{key}"):
        LLM("builtin:tiny-llama", **ARGS, **_nixl("kv_both", **extra))


def _worker_caches(heads: int, layers: int, fill: bool) -> list[torch.Tensor]:
    shape = (2, 8, BLOCK, heads, 4)  # [planes, blocks, block_size, kv heads, head dim]
    make = torch.randn if fill else torch.zeros
    return [make(shape) for _ in range(layers)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_a_decode_worker_reads_each_kv_head_from_the_prefill_rank_holding_it(
    prefill_tp: int, decode_tp: int
) -> None:
    """Blocks 1, 2 and 5 of the whole model's cache (prefill ranks' shards) land in blocks
    0, 3 and 4 of every decode rank, each rank with the KV heads it holds."""
    kwargs = {**ARGS, **_nixl("kv_both")}
    prefill, decode = (EngineConfig.from_kwargs(model="builtin:tiny-llama", **kwargs) for _ in "pd")
    heads = kv_head_count(prefill.model.hf_config)
    layers = prefill.model.num_hidden_layers
    whole = _worker_caches(heads, layers, fill=True)
    share = heads // prefill_tp
    sources = []
    for rank in range(prefill_tp):
        worker = NixlWorkerTransfer(prefill, 0, rank, prefill_tp, layers)
        shard = [c[:, :, :, rank * share : (rank + 1) * share].contiguous() for c in whole]
        worker.register(shard)
        sources.append((worker, shard))  # kept alive: the decode side reads their memory
    source = {
        "engine_id": prefill.kv_transfer.engine_id,
        "workers": [w.metadata() for w, _ in sources],
    }
    pairs = [(1, 0), (2, 3), (5, 4)]
    mine = heads // decode_tp
    for rank in range(decode_tp):
        worker = NixlWorkerTransfer(decode, 0, rank, decode_tp, layers)
        caches = _worker_caches(mine, layers, fill=False)
        worker.register(caches)
        assert worker.load(caches, {"r": pairs}, {"r": source}) == {}
        held = slice(rank * mine, (rank + 1) * mine)
        for got, want in zip(caches, whole, strict=True):
            for remote, local in pairs:
                assert torch.equal(got[:, local], want[:, remote, :, held])
            assert not got[:, [1, 2, 5, 6, 7]].any()  # nothing else written


def test_nixl_connector_refuses_data_parallel_ranks_by_name() -> None:
    with pytest.raises(ConfigError, match=r"^kv_transfer_config.kv_connector: NixlConnector names"):
        EngineConfig.from_kwargs(
            model="builtin:tiny-qwen3-moe", data_parallel_size=2, enable_expert_parallel=True,
            **ARGS, **_nixl("kv_both"),
        )  # fmt: skip
