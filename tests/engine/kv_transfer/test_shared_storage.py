"""``kv_transfer_config`` with ``SharedStorageConnector``: prompt blocks stored by one engine
and loaded by another (a replica of the same model on the node) or by the same engine after its
device cache evicted them, token-equal to an engine without the connector (fp32, greedy); a
stored block that is gone or cut short is recomputed, one with other bytes of the right size
changes the output (so the loads are what the engine reads); the roles; the refusals."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.builtin.catalog import make_tiny_lora
from engine.config import EngineConfig
from engine.core.block_pool import hash_block_tokens
from engine.errors import ConfigError
from engine.kv_transfer.scheduler import KVTransferScheduler
from engine.kv_transfer.store import kv_head_count
from engine.lora_request import LoRARequest

ARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}
BLOCK = 16
# Full prompt blocks: 6, 4 and 2 (the last token of a prompt is always computed).
LENGTHS = (100, 70, 33)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(n)]} for n in LENGTHS]


def _kv(path: Path, role: str = "kv_both") -> dict[str, Any]:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def _tokens(llm: LLM, prompts: list[Any], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _transfer(llm: LLM) -> KVTransferScheduler:
    transfer = llm.llm_engine.scheduler.kv_transfer
    assert transfer is not None
    return transfer


def _hashes(tokens: list[int], num_blocks: int) -> list[bytes]:
    """The chained block hashes of a prompt's first blocks (no salt, no adapter)."""
    hashes: list[bytes] = []
    for i in range(num_blocks):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tokens[i * BLOCK : (i + 1) * BLOCK], None))
    return hashes


def _files(llm: LLM) -> list[Path]:
    return sorted(_transfer(llm).store.directory.iterdir())


MODELS = ("tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v3")


@pytest.fixture(scope="module", params=MODELS)
def expected(request: pytest.FixtureRequest) -> tuple[str, list[list[int]]]:
    llm = LLM(f"builtin:{request.param}", **ARGS)
    return request.param, _tokens(llm, _prompts())


def test_another_engine_loads_the_stored_prompt_blocks_and_generates_the_same_tokens(
    expected: tuple[str, list[list[int]]], tmp_path: Path
) -> None:
    model, tokens = expected
    first = LLM(f"builtin:{model}", kv_transfer_config=_kv(tmp_path), **ARGS)
    assert _tokens(first, _prompts()) == tokens
    assert _transfer(first).hit_tokens == 0
    # Every full prompt block, one file per KV head (one for a latent cache).
    heads = kv_head_count(first.llm_engine.config.model.hf_config)
    assert len(_files(first)) == (6 + 4 + 2) * heads
    second = LLM(f"builtin:{model}", kv_transfer_config=_kv(tmp_path), **ARGS)
    outputs = second.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tokens
    assert [o.num_cached_tokens for o in outputs] == [96, 64, 32]
    transfer = _transfer(second)
    assert (transfer.hit_tokens, transfer.failed_tokens) == (192, 0)
    second.llm_engine.check_integrity()


def test_blocks_the_device_cache_evicted_come_back_from_the_store(tmp_path: Path) -> None:
    # 8 device blocks: the second prompt's 7 evict the first's from the prefix cache.
    args = {**ARGS, "max_model_len": 128, "num_kv_blocks": 8}
    one, other = _prompts()[0], _prompts(seed=1)[0]
    reference = LLM("builtin:tiny-llama", **args)
    expected = _tokens(reference, [one])
    llm = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args)
    assert _tokens(llm, [one]) == expected
    _tokens(llm, [other])
    bm = llm.llm_engine.block_manager
    on_device = bm.cached_prefix_tokens(one["prompt_token_ids"])
    assert on_device < 96, "the device still holds the whole prefix"
    assert _tokens(llm, [one]) == expected
    assert _transfer(llm).hit_tokens == 96 - on_device  # the device's hits first, then these


def test_a_block_gone_or_cut_short_is_recomputed_from_there(tmp_path: Path) -> None:
    prompts = _prompts()[:1]
    expected = _tokens(LLM("builtin:tiny-llama", **ARGS), prompts)
    writer = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **ARGS)
    _tokens(writer, prompts)
    hashes = _hashes(prompts[0]["prompt_token_ids"], 6)
    store = _transfer(writer).store
    # Block 2 of 6 cut short: the lookup finds all six, the load stops at it.
    path = store.path(hashes[2], "0.t1")  # one KV head's file of the block
    path.write_bytes(path.read_bytes()[:100])
    reader = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **ARGS)
    outputs = reader.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    transfer = _transfer(reader)
    assert (transfer.hit_tokens, transfer.failed_tokens) == (2 * BLOCK, 4 * BLOCK)
    assert outputs[0].num_cached_tokens == 2 * BLOCK
    reader.llm_engine.check_integrity()
    # Gone altogether: the lookup stops before it.
    os.unlink(store.path(hashes[1], "0.t0"))
    again = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **ARGS)
    assert _tokens(again, prompts) == expected
    assert (_transfer(again).hit_tokens, _transfer(again).failed_tokens) == (BLOCK, 0)


def test_other_bytes_in_a_stored_block_change_the_output(tmp_path: Path) -> None:
    """The engine reads the stored bytes: the same size, other values, another output."""
    prompts = _prompts()[:1]
    expected = _tokens(LLM("builtin:tiny-llama", **ARGS), prompts)
    writer = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **ARGS)
    _tokens(writer, prompts)
    for path in _files(writer):
        path.write_bytes(os.urandom(path.stat().st_size))
    reader = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **ARGS)
    assert _tokens(reader, prompts) != expected
    assert _transfer(reader).hit_tokens == 6 * BLOCK


def test_a_producer_only_saves_and_a_consumer_only_loads(tmp_path: Path) -> None:
    prompts = _prompts()
    consumer = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path, "kv_consumer"), **ARGS)
    expected = _tokens(consumer, prompts)
    assert _files(consumer) == [] and _transfer(consumer).hit_tokens == 0
    producer = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path, "kv_producer"), **ARGS)
    assert _tokens(producer, prompts) == expected
    assert len(_files(producer)) == 12 * 2  # tiny-llama's two KV heads
    again = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path, "kv_consumer"), **ARGS)
    assert _tokens(again, prompts) == expected
    assert _transfer(again).hit_tokens == 192


def test_n_samples_logprobs_and_a_request_without_reuse(tmp_path: Path) -> None:
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2, logprobs=2)
    reference = LLM("builtin:tiny-llama", **ARGS).generate(prompts, params, use_tqdm=False)
    LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **ARGS).generate(
        prompts, params, use_tqdm=False
    )
    llm = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **ARGS)
    got = llm.generate(prompts, params, use_tqdm=False)
    for want, have in zip(reference, got, strict=True):
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]
        for a, b in zip(want.outputs, have.outputs, strict=True):
            assert a.logprobs is not None and b.logprobs is not None
            for row_a, row_b in zip(a.logprobs, b.logprobs, strict=True):
                assert row_a.keys() == row_b.keys()
                for t in row_a:
                    assert row_a[t].logprob == pytest.approx(row_b[t].logprob, abs=1e-5)
    assert _transfer(llm).hit_tokens == 192
    # Prompt logprobs need every prompt position computed: nothing is loaded.
    before = _transfer(llm).hit_tokens
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert _transfer(llm).hit_tokens == before


def test_configs_the_connector_cannot_serve_are_refused_by_name(tmp_path: Path) -> None:
    kv = _kv(tmp_path)
    refused = [
        ({"kv_transfer_config": {**kv, "kv_connector": "LMCacheConnectorV1"}},
         r"^kv_transfer_config.kv_connector: must be one of 'SharedStorageConnector', "
         r"'NixlConnector'"),
        ({"kv_transfer_config": {**kv, "kv_role": "kv_sender"}},
         r"^kv_transfer_config.kv_role: must be one of 'kv_both', 'kv_producer', 'kv_consumer'"),
        ({"kv_transfer_config": {**kv, "kv_buffer_size": 1}},
         r"^kv_transfer_config.kv_buffer_size: must be one of the keys"),
        ({"kv_transfer_config": {**kv, "kv_connector_extra_config": {"max_storage_bytes": 10}}},
         r"^kv_transfer_config.kv_connector_extra_config.max_storage_bytes: must be an integer "
         r">= 1048576"),
        ({"kv_transfer_config": {"kv_role": "kv_both"}},
         r"^kv_transfer_config.kv_connector: is required"),
        ({"kv_transfer_config": "SharedStorageConnector"},
         r"^kv_transfer_config: must be a mapping"),
        ({"kv_transfer_config": kv, "enable_prefix_caching": False},
         r"^kv_transfer_config: needs enable_prefix_caching"),
    ]  # fmt: skip
    for kwargs, message in refused:
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(model="builtin:tiny-llama", **kwargs)
    with pytest.raises(ConfigError, match=r"^kv_transfer_config: SharedStorageConnector moves one"):
        EngineConfig.from_kwargs(model="builtin:tiny-gemma3", kv_transfer_config=kv)


@pytest.mark.parametrize(
    "extra",
    [
        {"kv_cache_dtype": "fp8"},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    ],
    ids=["fp8-kv", "ngram-speculation"],
)
def test_fp8_kv_and_speculation_engines_load_what_they_stored(
    extra: dict[str, Any], tmp_path: Path
) -> None:
    args = {**ARGS, **extra}
    expected = _tokens(LLM("builtin:tiny-llama", **args), _prompts())
    _tokens(LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args), _prompts())
    llm = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args)
    assert _tokens(llm, _prompts()) == expected
    assert _transfer(llm).hit_tokens == 192


def test_a_lora_adapters_blocks_are_its_own(tmp_path: Path) -> None:
    """Blocks computed under an adapter are stored under hashes that name it: a request with the
    adapter loads them, one without it (the base model's K/V differ) does not."""
    adapter = LoRARequest("a", 1, str(make_tiny_lora("tiny-llama", tmp_path / "adapter", seed=1)))
    args = {**ARGS, "enable_lora": True}
    store = tmp_path / "store"
    reference = LLM("builtin:tiny-llama", **args)
    with_adapter = [
        o.outputs[0].token_ids
        for o in reference.generate(_prompts(), GREEDY, lora_request=adapter, use_tqdm=False)
    ]
    writer = LLM("builtin:tiny-llama", kv_transfer_config=_kv(store), **args)
    writer.generate(_prompts(), GREEDY, lora_request=adapter, use_tqdm=False)
    base = LLM("builtin:tiny-llama", kv_transfer_config=_kv(store), **args)
    _tokens(base, _prompts())
    assert _transfer(base).hit_tokens == 0
    reader = LLM("builtin:tiny-llama", kv_transfer_config=_kv(store), **args)
    outputs = reader.generate(_prompts(), GREEDY, lora_request=adapter, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == with_adapter
    assert _transfer(reader).hit_tokens == 192


@pytest.mark.gpu
def test_on_a_gpu_the_store_is_host_memory_under_the_device_cache(tmp_path: Path) -> None:
    args = {**ARGS, "device": "cuda"}
    tokens = _tokens(LLM("builtin:tiny-llama", **args), _prompts())
    first = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args)
    assert _tokens(first, _prompts()) == tokens
    second = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args)
    outputs = second.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tokens
    assert [o.num_cached_tokens for o in outputs] == [96, 64, 32]
