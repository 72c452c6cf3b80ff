"""Quantized checkpoints at TP = 2 (two spawned ranks on gloo) give the tokens TP = 1 gives:
W4A16 with zero points (group scales and zero points split with their input columns in the
row-parallel layers) and FP8 with a static input scale per projection (each part of the fused
q/k/v and gate/up layers keeps its own scale on each rank), with the weights dequantized at
load and kept quantized."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.engine.quantization.quant_checkpoints import CASES, dense_model, write_compressed_tensors
from tests.engine.spawned_ranks import greedy_steps, rank_config, run_ranks, workers_on_one_group

PROMPTS = [[5, 9, 21, 7], [100, 3, 3, 8, 40, 41, 2] * 3, [17, 18, 300, 301, 7]]
STEPS = 10
TP_CASES = ("w4a16-asym", "fp8-static")


def _config(path: str, rank: int) -> EngineConfig:
    return rank_config(
        rank, model=path, dtype="float32", tensor_parallel_size=2, num_kv_blocks=64,
        max_model_len=128,
    )  # fmt: skip


def _rank_main(rank: int, ports: Any, results: Any, paths: dict[str, str]) -> None:
    try:
        configs = {case: _config(path, rank) for case, path in paths.items()}
        out = {
            case: greedy_steps(worker, PROMPTS, STEPS)
            for case, worker in workers_on_one_group(rank, 2, ports, configs)
        }
        results.put((rank, out))
    except BaseException as exc:
        results.put((rank, repr(exc)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quant-tp")
    dense = dense_model(root, "llama")
    paths = {}
    for case in TP_CASES:
        scheme, fmt, input_scale = CASES[case]
        paths[case] = str(write_compressed_tensors(dense, root / case, scheme, fmt, input_scale))
    return paths


# Each mode spawns two ranks and loads both checkpoints (~20 s): the kept mode runs in the full
# suite only.
@pytest.fixture(
    scope="module", params=["dequantized", pytest.param("kept", marks=pytest.mark.slow)]
)
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Weights dequantized at load, or kept quantized (each rank holds its shard of the
    packed / FP8 weights, scales and zero points); the spawned ranks inherit the setting."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLM_CLUSTER_CPU_KEEP_QUANTIZED", "1" if request.param == "kept" else "0")
        yield request.param


@pytest.fixture(scope="module")
def tp2_tokens(checkpoints: dict[str, str], mode: str) -> dict[int, Any]:
    return run_ranks(_rank_main, 2, checkpoints)


@pytest.mark.slow
@pytest.mark.parametrize("case", TP_CASES)
def test_quantized_tp2_equals_tp1(
    checkpoints: dict[str, str], tp2_tokens: dict[int, Any], case: str, mode: str
) -> None:
    assert tp2_tokens[0][case] == tp2_tokens[1][case], "the ranks disagree"
    llm = LLM(checkpoints[case], dtype="float32", num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tp2_tokens[0][case]
