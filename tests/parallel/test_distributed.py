"""Process groups, collectives, stage transfer and TP layers, with two gloo processes.

One pair of processes runs every check once (starting them dominates the cost) and hands its
results back; each test then asserts one behaviour against an unsharded torch reference.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parallel.distributed import (
    connect_store,
    coordinates,
    create_store,
    destroy_distributed,
    init_distributed,
    pp_group_ranks,
    recv_intermediate,
    send_intermediate,
    tp_group_ranks,
)
from parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from parallel.state import GroupCoordinator
from tests.engine.spawned_ranks import run_ranks

HIDDEN, INTER, VOCAB = 16, 24, 100  # VOCAB is not a multiple of the padding: ranks differ in rows
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 1, 4  # TP = 2 > 1 KV head: the KV head is replicated


def reference_tensors() -> dict[str, torch.Tensor]:
    """Full (unsharded) weights and inputs; every process and the test draw the same ones."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    qkv_out = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    return {
        "x": randn(5, HIDDEN),
        "w_col": randn(INTER, HIDDEN),
        "b_col": randn(INTER),
        "w_row": randn(HIDDEN, INTER),
        "b_row": randn(HIDDEN),
        "w_gate": randn(INTER, HIDDEN),
        "w_up": randn(INTER, HIDDEN),
        "w_q": randn(NUM_HEADS * HEAD_DIM, HIDDEN),
        "w_k": randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        "w_v": randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        "b_qkv": randn(qkv_out),
        "embedding": randn(VOCAB, HIDDEN),
        "token_ids": torch.tensor([0, 1, 49, 50, 63, 64, 65, 99]),
    }


def _load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if shard_id is None:
        param.weight_loader(param, loaded)
    else:
        param.weight_loader(param, loaded, shard_id)


def _layer_outputs(tp: GroupCoordinator, t: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    col = ColumnParallelLinear(HIDDEN, INTER, bias=True, tp=tp)
    row = RowParallelLinear(INTER, HIDDEN, bias=True, tp=tp)
    _load(col.weight, t["w_col"])
    _load(col.bias, t["b_col"])
    _load(row.weight, t["w_row"])
    _load(row.bias, t["b_row"])
    out["column_then_row"] = row(col(t["x"]))

    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp=tp)
    _load(gate_up.weight, t["w_gate"], 0)
    _load(gate_up.weight, t["w_up"], 1)
    down = RowParallelLinear(INTER, HIDDEN, tp=tp)
    _load(down.weight, t["w_row"])
    gate, up = gate_up(t["x"]).chunk(2, dim=-1)
    out["mlp"] = down(F.silu(gate) * up)

    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, bias=True, tp=tp)
    q_size = NUM_HEADS * HEAD_DIM
    kv_size = NUM_KV_HEADS * HEAD_DIM
    b_q, b_k, b_v = t["b_qkv"].split([q_size, kv_size, kv_size])
    for shard, w, b in (("q", t["w_q"], b_q), ("k", t["w_k"], b_k), ("v", t["w_v"], b_v)):
        _load(qkv.weight, w, shard)
        _load(qkv.bias, b, shard)
    out["qkv"] = qkv(t["x"])

    embed = VocabParallelEmbedding(VOCAB, HIDDEN, tp=tp)
    _load(embed.weight, t["embedding"])
    out["embedding"] = embed(t["token_ids"])

    head = ParallelLMHead(VOCAB, HIDDEN, tp=tp)
    _load(head.weight, t["embedding"])
    out["logits"] = head.compute_logits(t["x"])
    return out


def _collective_outputs(tp: GroupCoordinator) -> dict[str, Any]:
    mine = torch.full((2, 3), float(tp.rank + 1))
    return {
        "all_reduce": tp.all_reduce(mine.clone()),
        "all_gather": tp.all_gather(mine.clone(), dim=-1),
        "gather": tp.gather(mine.clone(), dim=0),
    }


def _stage_transfer(pp: GroupCoordinator) -> dict[str, Any]:
    hidden = torch.arange(12.0).view(4, 3)
    residual = -hidden
    if pp.is_first:
        send_intermediate(pp, hidden, residual)
        return {}
    received = recv_intermediate(pp, 4, 3, torch.float32, torch.device("cpu"))
    return {"received": received}


def _rank_main(rank: int, ports: Any, results: Any) -> None:
    try:
        torch.set_num_threads(1)
        if rank == 0:
            rendezvous = create_store("127.0.0.1", 2, timeout_s=60)
            ports.put(rendezvous.port)
            ports.put(rendezvous.port)
            store = rendezvous.store
        else:
            store = connect_store("127.0.0.1", ports.get(timeout=60), 2, timeout_s=60)
        cpu = torch.device("cpu")
        tp_ctx = init_distributed(store, rank, tp_size=2, pp_size=1, device=cpu, timeout_s=60)
        pp_ctx = init_distributed(store, rank, tp_size=1, pp_size=2, device=cpu, timeout_s=60)
        t = reference_tensors()
        out = {"tp": (tp_ctx.tp.rank, tp_ctx.tp.size), "pp": (pp_ctx.pp.rank, pp_ctx.pp.size)}
        out.update(_collective_outputs(tp_ctx.tp))
        out.update(_layer_outputs(tp_ctx.tp, t))
        out.update(_stage_transfer(pp_ctx.pp))
        destroy_distributed()
        # numpy pickles by value; a tensor would be passed as shared memory that dies with us.
        results.put((rank, _convert(out, torch.Tensor, lambda x: x.numpy())))
    except BaseException as exc:
        results.put((rank, repr(exc)))


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    collected = run_ranks(_rank_main, 2, timeout_s=120)
    return [_convert(collected[r], np.ndarray, torch.from_numpy) for r in range(2)]


def _convert(value: Any, kind: type, fn: Any) -> Any:
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, dict):
        return {k: _convert(v, kind, fn) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_convert(v, kind, fn) for v in value)
    return value


def test_each_rank_gets_its_group_coordinates(ranks: list[dict[str, Any]]) -> None:
    assert [r["tp"] for r in ranks] == [(0, 2), (1, 2)]
    assert [r["pp"] for r in ranks] == [(0, 2), (1, 2)]


def test_all_reduce_sums_over_the_group(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert torch.equal(r["all_reduce"], torch.full((2, 3), 3.0))


def test_all_gather_concatenates_in_rank_order(ranks: list[dict[str, Any]]) -> None:
    expected = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], dim=-1)
    for r in ranks:
        assert torch.equal(r["all_gather"], expected)


def test_gather_delivers_to_rank_0_only(ranks: list[dict[str, Any]]) -> None:
    expected = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], dim=0)
    assert torch.equal(ranks[0]["gather"], expected)
    assert ranks[1]["gather"] is None


def test_next_stage_receives_hidden_and_residual(ranks: list[dict[str, Any]]) -> None:
    hidden, residual = ranks[1]["received"]
    assert torch.equal(hidden, torch.arange(12.0).view(4, 3))
    assert torch.equal(residual, -torch.arange(12.0).view(4, 3))


def test_column_then_row_parallel_equals_unsharded_with_bias_added_once(
    ranks: list[dict[str, Any]],
) -> None:
    t = reference_tensors()
    expected = F.linear(F.linear(t["x"], t["w_col"], t["b_col"]), t["w_row"], t["b_row"])
    for r in ranks:
        torch.testing.assert_close(r["column_then_row"], expected)


def test_merged_gate_up_mlp_equals_unsharded(ranks: list[dict[str, Any]]) -> None:
    t = reference_tensors()
    x = t["x"]
    expected = F.linear(F.silu(F.linear(x, t["w_gate"])) * F.linear(x, t["w_up"]), t["w_row"])
    for r in ranks:
        torch.testing.assert_close(r["mlp"], expected)


def test_qkv_splits_query_heads_and_replicates_the_kv_head(ranks: list[dict[str, Any]]) -> None:
    t = reference_tensors()
    w = torch.cat([t["w_q"], t["w_k"], t["w_v"]])
    full_q, full_k, full_v = F.linear(t["x"], w, t["b_qkv"]).split(
        [NUM_HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1
    )
    heads_per_rank = NUM_HEADS // 2
    for rank, r in enumerate(ranks):
        q, k, v = r["qkv"].split([heads_per_rank * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
        q_cols = slice(rank * heads_per_rank * HEAD_DIM, (rank + 1) * heads_per_rank * HEAD_DIM)
        torch.testing.assert_close(q, full_q[:, q_cols])
        torch.testing.assert_close(k, full_k)
        torch.testing.assert_close(v, full_v)


def test_vocab_parallel_embedding_equals_unsharded(ranks: list[dict[str, Any]]) -> None:
    t = reference_tensors()
    expected = F.embedding(t["token_ids"], t["embedding"])
    for r in ranks:
        torch.testing.assert_close(r["embedding"], expected)


def test_parallel_lm_head_gathers_full_vocabulary_logits_to_rank_0(
    ranks: list[dict[str, Any]],
) -> None:
    t = reference_tensors()
    torch.testing.assert_close(ranks[0]["logits"], F.linear(t["x"], t["embedding"]))
    assert ranks[1]["logits"] is None


def test_tp_groups_are_consecutive_ranks_within_a_stage() -> None:
    assert tp_group_ranks(tp_size=2, pp_size=2) == [[0, 1], [2, 3]]
    assert tp_group_ranks(tp_size=4, pp_size=2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_pp_groups_link_the_same_tp_rank_across_stages() -> None:
    assert pp_group_ranks(tp_size=2, pp_size=2) == [[0, 2], [1, 3]]
    assert pp_group_ranks(tp_size=4, pp_size=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_coordinates_of_a_global_rank() -> None:
    assert [coordinates(r, tp_size=4, pp_size=2) for r in (0, 3, 4, 7)] == [
        (0, 0, 0),
        (3, 0, 0),
        (0, 1, 0),
        (3, 1, 0),
    ]
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 8\)"):
        coordinates(8, tp_size=4, pp_size=2)
    # Data parallel: DP-major, each DP rank's TP group consecutive.
    assert [coordinates(r, tp_size=2, pp_size=1, dp_size=2) for r in range(4)] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 0, 1),
        (1, 0, 1),
    ]
    assert tp_group_ranks(tp_size=2, pp_size=1, dp_size=2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 4\)"):
        coordinates(4, tp_size=2, pp_size=1, dp_size=2)


def _non_loopback_address() -> str:
    # Connecting a UDP socket sends nothing; it only picks the interface of the default route.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return s.getsockname()[0]


def test_rendezvous_store_listens_only_on_the_given_address() -> None:
    address = _non_loopback_address()
    assert not address.startswith("127.")
    rendezvous = create_store(address, world_size=1, timeout_s=5)
    try:
        assert rendezvous.port > 0
        with socket.create_connection((address, rendezvous.port), timeout=5):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", rendezvous.port), timeout=5)
    finally:
        rendezvous.close()


def test_rendezvous_with_a_missing_peer_times_out_instead_of_hanging() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_join_alone, args=(results,))
    proc.start()
    try:
        elapsed, error = results.get(timeout=60)
    except queue.Empty:
        pytest.fail("init_distributed hung for 60 s with a 2 s timeout")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert error is not None
    assert elapsed < 20


def _join_alone(results: Any) -> None:
    rendezvous = create_store("127.0.0.1", 2, timeout_s=2)
    start = time.monotonic()
    error = None
    try:
        init_distributed(rendezvous.store, 0, 2, 1, torch.device("cpu"), timeout_s=2)
    except Exception as exc:
        error = repr(exc)
    results.put((time.monotonic() - start, error))
