"""Decode CUDA graphs: which workers use them, the buckets, and the static buffers a graph
reads. What a graph captures is the stage's forward over those buffers, so on CPU (Triton
through its interpreter) that forward is checked against the eager step, for a whole model
and for the second of two pipeline stages; replay itself is checked in the gpu tier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import (
    DecodeGraphBuffers,
    cuda_graphs_disabled_reason,
    decode_batch_buckets,
)
from engine.worker.model_loader import load_model
from engine.worker.model_runner import ModelRunner
from engine.worker.step_inputs import StepInputs
from engine.worker.step_messages import CachedRequestData, ExecuteModelRequest, NewRequestData
from llm_kernels.attention_metadata import AttentionMetadata
from parallel.state import GroupCoordinator, ParallelContext

CPU = torch.device("cpu")


def test_buckets_are_powers_of_two_to_8_then_multiples_of_8() -> None:
    assert decode_batch_buckets(1) == (1,)
    assert decode_batch_buckets(5) == (1, 2, 4, 5)
    assert decode_batch_buckets(20) == (1, 2, 4, 8, 16, 24)
    assert decode_batch_buckets(1000)[-3:] == (240, 248, 256)


def test_cuda_with_triton_uses_graphs_whatever_the_parallel_shape() -> None:
    # The function takes no TP / PP size: collectives are captured, transfers stay outside.
    assert (
        cuda_graphs_disabled_reason(
            device_type="cuda", kernel_backend="triton", enforce_eager=False, lora_enabled=False
        )
        is None
    )


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"device_type": "cpu"}, "need a CUDA device"),
        ({"enforce_eager": True}, "enforce_eager"),
        ({"kernel_backend": "torch"}, "torch kernel backend"),
        ({"lora_enabled": True}, "LoRA"),
    ],
)
def test_graphs_are_off_with_a_reason(overrides: dict[str, object], reason: str) -> None:
    args: dict[str, object] = {
        "device_type": "cuda",
        "kernel_backend": "triton",
        "enforce_eager": False,
        "lora_enabled": False,
    }
    args.update(overrides)
    assert reason in (cuda_graphs_disabled_reason(**args) or "")  # type: ignore[arg-type]


def test_a_cpu_runner_never_uses_graphs() -> None:
    config = EngineConfig.from_kwargs(model="builtin:tiny-llama", device="cpu")
    runner = ModelRunner(config, load_model(config, ParallelContext(), CPU), CPU)
    runner.initialize_kv_cache(4, 0)
    assert not runner.uses_cuda_graphs()
    assert runner.graph_runner is None
    assert runner.capture_cuda_graphs() == 0


def decode_metadata(n: int, seq_lens: list[int], block_size: int = 16) -> AttentionMetadata:
    block_table = np.arange(n * 2, dtype=np.int32).reshape(n, 2)
    positions = np.array(seq_lens) - 1
    slots = block_table[np.arange(n), positions // block_size].astype(np.int64) * block_size
    return AttentionMetadata.build(
        query_lens=np.ones(n, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_table=block_table,
        slot_mapping=slots + positions % block_size,
        block_size=block_size,
        device=CPU,
    )


def test_loading_a_batch_pads_it_to_its_bucket_with_rows_that_write_and_read_nothing() -> None:
    buffers = DecodeGraphBuffers(CPU, block_size=16, max_model_len=64, max_num_seqs=16)
    buffers.slot_mapping.fill_(99)  # stale values of an earlier, larger batch
    buffers.seq_lens.fill_(7)
    meta = decode_metadata(3, [5, 17, 30])
    bucket = buffers.load(torch.tensor([11, 12, 13]), torch.tensor([4, 16, 29]), meta)
    assert bucket == 4
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.slot_mapping[3].item() == -1
    assert buffers.seq_lens[:4].tolist() == [5, 17, 30, 0]
    assert buffers.block_table[:3, :2].tolist() == meta.block_table.tolist()
    static = buffers.metadata(bucket)
    assert (static.num_seqs, static.max_query_len, static.max_seq_len) == (4, 1, 64)
    assert static.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_a_later_stage_loads_hidden_and_residual_and_zeroes_their_padding() -> None:
    buffers = DecodeGraphBuffers(
        CPU, block_size=16, max_model_len=64, max_num_seqs=8, hidden_size=4
    )
    buffers.hidden.fill_(5.0)  # type: ignore[union-attr]
    hidden, residual = torch.ones(3, 4), torch.full((3, 4), 2.0)
    meta = decode_metadata(3, [5, 6, 7])
    ids, pos = torch.zeros(3, dtype=torch.int64), torch.tensor([4, 5, 6])
    assert buffers.load(ids, pos, meta, hidden, residual) == 4
    assert buffers.hidden[:4].sum(dim=1).tolist() == [4.0, 4.0, 4.0, 0.0]  # type: ignore[index]
    assert buffers.residual[:3].eq(2.0).all()  # type: ignore[index]
    with pytest.raises(ValueError, match="hidden, residual"):
        buffers.load(ids, pos, meta)


def test_a_batch_above_the_largest_bucket_or_a_prefill_does_not_run_in_a_graph() -> None:
    buffers = DecodeGraphBuffers(CPU, block_size=16, max_model_len=64, max_num_seqs=2)
    assert buffers.can_run(decode_metadata(2, [3, 4]))
    assert not buffers.can_run(decode_metadata(3, [3, 4, 5]))
    prefill = AttentionMetadata.build(
        query_lens=np.array([3], dtype=np.int32),
        seq_lens=np.array([3], dtype=np.int32),
        block_table=np.zeros((1, 1), dtype=np.int32),
        slot_mapping=np.arange(3),
        block_size=16,
        device=CPU,
    )
    assert not buffers.can_run(prefill)
    with pytest.raises(ValueError, match="num_seqs"):
        buffers.bucket_for(3)


# ---- the captured forward, run eagerly on CPU through the Triton interpreter ---------------

PROMPTS = [[5, 9, 21, 7], [100, 3, 3, 8, 40, 41, 2], [17, 18]]
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def triton_config(**kwargs: object) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model="builtin:tiny-llama",
        device="cpu",
        attention_backend="triton",
        max_num_seqs=8,
        max_model_len=64,
        **kwargs,
    )


def prefill_then_decode_requests(
    first_tokens: list[int],
) -> tuple[ExecuteModelRequest, ExecuteModelRequest]:
    new = [
        NewRequestData(
            req_id=str(i),
            prompt_token_ids=p,
            sampling_params=GREEDY,
            block_ids=[2 * i, 2 * i + 1],
            num_computed_tokens=0,
        )
        for i, p in enumerate(PROMPTS)
    ]
    prefill = ExecuteModelRequest(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=[],
        num_scheduled_tokens={str(i): len(p) for i, p in enumerate(PROMPTS)},
        total_num_scheduled_tokens=sum(map(len, PROMPTS)),
        finished_req_ids=[],
    )
    decode = ExecuteModelRequest(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[
            CachedRequestData(
                req_id=str(i), new_token_ids=[t], new_block_ids=[], num_computed_tokens=len(p)
            )
            for i, (p, t) in enumerate(zip(PROMPTS, first_tokens))
        ],
        num_scheduled_tokens={str(i): 1 for i in range(len(PROMPTS))},
        total_num_scheduled_tokens=len(PROMPTS),
        finished_req_ids=[],
    )
    return prefill, decode


def decode_inputs(runner: ModelRunner) -> tuple[StepInputs, StepInputs]:
    """Run the prefill on ``runner`` (filling its KV cache); the prefill's and the decode
    step's inputs."""
    prefill, _ = prefill_then_decode_requests([0, 0, 0])
    runner.update_states(prefill)
    prefill_inputs = runner.prepare_inputs(prefill)
    out = runner.sample(prefill_inputs, runner.forward(prefill_inputs)[0])
    assert out is not None
    _, decode = prefill_then_decode_requests([t[0] for t in out.sampled_token_ids])
    runner.update_states(decode)
    return prefill_inputs, runner.prepare_inputs(decode)


def test_static_buffer_forward_equals_the_eager_decode_step() -> None:
    config = triton_config()
    runner = ModelRunner(config, load_model(config, ParallelContext(), CPU), CPU)
    runner.initialize_kv_cache(8, 0)
    _, inputs = decode_inputs(runner)
    eager, _ = runner.forward(inputs)
    buffers = DecodeGraphBuffers(CPU, block_size=16, max_model_len=64, max_num_seqs=8)
    bucket = buffers.load(inputs.input_ids, inputs.positions, inputs.metadata)
    with torch.inference_mode():
        static, residual = buffers.forward(runner.model, bucket)
    assert bucket == 4 and residual is None
    torch.testing.assert_close(static[:3], eager, rtol=1e-5, atol=1e-5)


def test_second_pipeline_stage_forward_from_static_hidden_equals_eager() -> None:
    config = triton_config()
    stages = []
    for rank in range(2):
        ctx = ParallelContext(pp=GroupCoordinator(rank=rank, size=2, ranks=(0, 1)))
        runner = ModelRunner(config, load_model(config, ctx, CPU), CPU, ctx)
        runner.initialize_kv_cache(8, 0)
        stages.append(runner)
    # Inputs from a whole-model runner: the same metadata every stage sees.
    whole = ModelRunner(config, load_model(config, ParallelContext(), CPU), CPU)
    whole.initialize_kv_cache(8, 0)
    prefill, decode = decode_inputs(whole)
    with torch.inference_mode():
        for step in (prefill, decode):
            hidden, residual = stages[0].forward(step)
            last, _ = stages[1].forward(step, hidden, residual)
    buffers = DecodeGraphBuffers(
        CPU, block_size=16, max_model_len=64, max_num_seqs=8, hidden_size=hidden.shape[1]
    )
    bucket = buffers.load(decode.input_ids, decode.positions, decode.metadata, hidden, residual)
    with torch.inference_mode():
        static, _ = buffers.forward(stages[1].model, bucket)
    torch.testing.assert_close(static[:3], last, rtol=1e-5, atol=1e-5)
    # And the two stages together equal the whole model.
    torch.testing.assert_close(last, whole.forward(decode)[0], rtol=1e-5, atol=1e-5)
