"""Expert load of an MoE model (``engine.models.expert_load``): every computed token counts once
per top-k expert in each sparse layer, none in a dense layer, padding rows of a decode bucket
not at all; the counts reach the engine's stats snapshot; a dense model reports none."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.client.async_llm_engine import AsyncLLMEngine
from engine.models.expert_load import ExpertLoadCounter
from engine.models.moe import SparseMoeBlock
from tests.engine.spawned_ranks import rendezvous, run_ranks
from tests.engine.worker.test_cuda_graphs_parallel import make_bucket_runner

MODEL = "builtin:tiny-qwen3-moe"  # layers 0 and 2 sparse (8 experts, top-2), layer 1 dense
TOP_K = 2
NUM_EXPERTS = 8


def _prompts(n: int, seed: int = 3) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    max_tokens = [rng.randint(2, 12) for _ in range(n)]
    return prompts, max_tokens


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> None:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _routing_recorder(llm: LLM) -> dict[int, Counter[int]]:
    """An independent count: each sparse layer's router logits, recomputed from the router's
    input and weight and top-k'd by a forward hook."""
    seen: dict[int, Counter[int]] = {}
    model = llm.llm_engine.executor.worker.runner.model
    for layer, decoder_layer in model.model.layers.items():
        mlp = decoder_layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            counts = seen.setdefault(int(layer), Counter())

            def hook(gate: Any, inputs: Any, _out: Any, counts: Counter[int] = counts) -> None:
                logits = torch.nn.functional.linear(inputs[0], gate.weight)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                counts.update(torch.topk(probs, TOP_K, dim=-1).indices.flatten().tolist())

            mlp.gate.register_forward_hook(hook)
    return seen


def test_each_sparse_layer_counts_every_computed_token_top_k_times() -> None:
    llm = LLM(MODEL, enable_prefix_caching=False, max_num_batched_tokens=64, num_kv_blocks=256)
    recorded = _routing_recorder(llm)
    prompts, max_tokens = _prompts(6)
    _generate(llm, prompts, max_tokens)
    # The last sampled token of each request is never fed back.
    computed = sum(len(p) + m - 1 for p, m in zip(prompts, max_tokens))

    load = llm.llm_engine.executor.expert_load()

    assert sorted(load) == [0, 2]
    for layer, tokens in load.items():
        assert len(tokens) == NUM_EXPERTS
        assert sum(tokens) == computed * TOP_K, f"layer {layer}"
        assert tokens == [recorded[layer][e] for e in range(NUM_EXPERTS)], f"layer {layer}"
    counter = llm.llm_engine.executor.worker.expert_load_counter
    assert counter is not None and counter.tokens[1].sum().item() == 0  # the dense layer


def test_padding_rows_of_a_decode_bucket_are_not_counted() -> None:
    llm = LLM(MODEL, enable_prefix_caching=False, num_kv_blocks=64, max_model_len=128)
    runner = llm.llm_engine.executor.worker.runner
    runner.graph_runner = make_bucket_runner(runner)
    # Three requests decode together in the 4-row bucket: one padding row per decode step.
    prompts, max_tokens = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]], [6, 6, 6]

    _generate(llm, prompts, max_tokens)

    computed = sum(len(p) + m - 1 for p, m in zip(prompts, max_tokens))
    load = llm.llm_engine.executor.expert_load()
    assert {layer: sum(tokens) for layer, tokens in load.items()} == {
        0: computed * TOP_K,
        2: computed * TOP_K,
    }


def test_the_engine_stats_carry_the_expert_load() -> None:
    engine = AsyncLLMEngine.from_engine_args(
        model=MODEL, enable_prefix_caching=False, num_kv_blocks=64
    )
    prompt = [11, 12, 13, 14, 15]

    async def run() -> Any:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": prompt}, params):
            pass
        return await engine.get_stats()

    try:
        stats = asyncio.run(run())
    finally:
        engine.shutdown()
    computed = len(prompt) + 4 - 1
    assert {layer: sum(t) for layer, t in stats.moe_expert_tokens.items()} == {
        0: computed * TOP_K,
        2: computed * TOP_K,
    }


def test_a_dense_model_reports_no_expert_load() -> None:
    llm = LLM("builtin:tiny-qwen3", num_kv_blocks=64)
    assert llm.llm_engine.executor.worker.expert_load_counter is None
    assert llm.llm_engine.executor.expert_load() == {}


def test_counter_reads_only_sparse_layers_and_resets() -> None:
    counter = ExpertLoadCounter(3, 4, [2, 0], torch.device("cpu"))
    counter.add(0, torch.tensor([[0, 1], [1, 3]]))
    counter.add(2, torch.tensor([[2, 2]]))
    assert counter.read() == {0: [1, 2, 0, 1], 2: [0, 0, 2, 0]}
    counter.reset()
    assert counter.read() == {0: [0, 0, 0, 0], 2: [0, 0, 0, 0]}


def _tp_rank_main(rank: int, ports: Any, results: Any) -> None:
    try:
        from engine.worker.worker import Worker
        from tests.engine.models.test_moe import _greedy_steps, _worker_config

        worker = Worker(_worker_config("tiny-qwen3-moe", 2, rank))
        worker.init_device()
        rendezvous(worker, rank, 2, ports)
        worker.load_model()
        worker.initialize_cache(64, 0)
        _greedy_steps(worker, "tp")
        results.put((rank, worker.expert_load()))
        worker.shutdown()
    except BaseException as exc:
        results.put((rank, repr(exc)))


@pytest.mark.slow
def test_tensor_parallel_ranks_count_once_on_rank_0() -> None:
    from tests.engine.models.test_moe import TP_DECODE_STEPS, TP_PROMPTS

    collected = run_ranks(_tp_rank_main, 2)
    computed = sum(map(len, TP_PROMPTS)) + TP_DECODE_STEPS * len(TP_PROMPTS)
    assert {layer: sum(t) for layer, t in collected[0].items()} == {
        0: computed * TOP_K,
        2: computed * TOP_K,
    }
    assert collected[1] == {}


@pytest.fixture(autouse=True)
def _single_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
