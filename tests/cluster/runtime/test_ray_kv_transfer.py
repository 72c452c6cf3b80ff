"""``kv_transfer_config`` (``SharedStorageConnector``) with workers on Ray: TP = 2 stores a
block's KV heads from two ranks and a second TP = 2 engine loads them; pipelined PP = 2
likewise (a file per stage and head); engines of other TP sizes share blocks (TP 2 -> TP 1, TP
1 -> TP 2: the heads re-sharded on load); a block cut short on one rank only is recomputed by
all (the head takes the least any rank loaded). Every output token-equal to TP = 1 without the
connector (fp32, greedy)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.core.block_pool import hash_block_tokens

ARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}
BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=4)]


def _prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(n)]} for n in (100, 40)]


def _kv(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def _run(llm: LLM) -> tuple[list[list[int]], int, int]:
    try:
        outputs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        transfer = llm.llm_engine.scheduler.kv_transfer
        assert transfer is not None
        llm.llm_engine.check_integrity()
        tokens = [o.outputs[0].token_ids for o in outputs]
        return tokens, transfer.hit_tokens, transfer.failed_tokens
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM("builtin:tiny-llama", **ARGS)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    ("shape", "files_per_block"),
    # tiny-llama has 2 KV heads: a file per head (per stage with PP)
    [({"tensor_parallel_size": 2}, 2), ({"pipeline_parallel_size": 2}, 4)],
    ids=["tp2", "pp2"],
)
def test_a_blocks_shards_stored_by_one_engine_and_loaded_by_another(
    shape: dict[str, int], files_per_block: int, expected: list[list[int]], tmp_path: Path
) -> None:
    args = {**ARGS, **shape, "distributed_executor_backend": "ray"}
    assert _run(LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args)) == (
        expected, 0, 0
    )  # fmt: skip
    (namespace,) = tmp_path.iterdir()
    assert len(list(namespace.iterdir())) == files_per_block * (6 + 2)  # every prompt block
    reader = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args)
    assert _run(reader) == (expected, (6 + 2) * BLOCK, 0)


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2)])
def test_engines_of_other_tp_sizes_load_each_others_blocks(
    writer_tp: int, reader_tp: int, expected: list[list[int]], tmp_path: Path
) -> None:
    def engine(tp: int) -> LLM:
        backend = "ray" if tp > 1 else "uni"
        args = {**ARGS, "tensor_parallel_size": tp, "distributed_executor_backend": backend}
        return LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args)

    assert _run(engine(writer_tp)) == (expected, 0, 0)
    assert _run(engine(reader_tp)) == (expected, (6 + 2) * BLOCK, 0)


def test_a_block_cut_short_on_one_rank_is_recomputed_by_every_rank(
    expected: list[list[int]], tmp_path: Path
) -> None:
    args = {**ARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "ray"}
    _run(LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args))
    tokens = _prompts()[0]["prompt_token_ids"]
    hashes: list[bytes] = []
    for i in range(3):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tokens[i * BLOCK : (i + 1) * BLOCK], None))
    (namespace,) = tmp_path.iterdir()
    shard_1 = namespace / f"{hashes[2].hex()}.0.t1"  # rank 1's KV head
    shard_1.write_bytes(shard_1.read_bytes()[:64])  # rank 1 fails at block 2; rank 0 loads all
    reader = LLM("builtin:tiny-llama", kv_transfer_config=_kv(tmp_path), **args)
    # The 100-token prompt loads 2 of its 6 blocks, the 40-token one both of its 2.
    assert _run(reader) == (expected, (2 + 2) * BLOCK, 4 * BLOCK)
