"""Scheduler, driven without a model: a fake step samples token 7 for every finished row."""

from __future__ import annotations

import numpy as np

from engine.config_sections import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput, make_execute_model_request
from engine.multimodal.inputs import image_feature
from engine.sampling_params import SamplingParams

BS = 4


def make_scheduler(
    num_blocks: int = 64, *, budget: int = 64, max_seqs: int = 16, cpu_blocks: int = 0, **kw: object
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64, **kw
    )
    return Scheduler(cfg, BlockManager(num_blocks, BS, num_cpu_blocks=cpu_blocks))


def make_request(
    rid: str, n: int, max_tokens: int = 4, arrival: float = 0.0, priority: int = 0
) -> Request:
    return Request(
        rid,
        list(range(100, 100 + n)),
        SamplingParams(),
        max_tokens=max_tokens,
        arrival_time=arrival,
        priority=priority,
    )


def run_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    make_execute_model_request(out)
    finished_rows = [
        rid
        for rid, n in out.num_scheduled_tokens.items()
        if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens
    ]
    s.update_from_output(out, finished_rows, [[7] for _ in finished_rows])
    return out


def test_prompt_longer_than_budget_is_chunked_across_steps() -> None:
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 20))
    assert [run_step(s).num_scheduled_tokens["a"] for _ in range(3)] == [8, 8, 4]
    assert s.requests["a"].output_token_ids == [7]


def test_decodes_are_scheduled_before_new_prefills() -> None:
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 4, max_tokens=8, arrival=0))
    run_step(s)
    s.add_request(make_request("b", 30, arrival=1))
    out = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}


def test_sequence_cap_limits_running_requests() -> None:
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, arrival=i))
    out = run_step(s)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]


def test_requests_finish_at_max_tokens_and_free_blocks() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=3))
    while s.has_unfinished_requests():
        run_step(s)
    assert s.block_manager.num_free_blocks == 64
    s.block_manager.check_integrity()


def test_recompute_preemption_picks_latest_arrival_and_resumes() -> None:
    # 6 blocks of 4 slots: two requests of 8 prompt tokens + 8 outputs cannot both finish.
    s = make_scheduler(num_blocks=6)
    a, b = (
        make_request("a", 8, max_tokens=8, arrival=0),
        make_request("b", 8, max_tokens=8, arrival=1),
    )
    s.add_request(a)
    s.add_request(b)
    preempted: list[str] = []
    resumed = False
    while s.has_unfinished_requests():
        out = run_step(s)
        preempted += out.preempted_req_ids
        resumed |= bool(out.resumed_req_ids)
        s.block_manager.check_integrity()
    assert preempted and set(preempted) == {"b"}
    assert resumed
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert s.block_manager.num_free_blocks == 6


def test_priority_policy_preempts_lowest_priority() -> None:
    s = make_scheduler(num_blocks=6, policy="priority")
    # Lower value = higher priority; "late" arrives last but outranks "early".
    early = make_request("early", 8, max_tokens=8, arrival=0, priority=5)
    late = make_request("late", 8, max_tokens=8, arrival=1, priority=0)
    s.add_request(early)
    s.add_request(late)
    preempted: list[str] = []
    while s.has_unfinished_requests():
        preempted += run_step(s).preempted_req_ids
    assert set(preempted) == {"early"}


def test_priority_policy_admits_highest_priority_first() -> None:
    s = make_scheduler(max_seqs=1, policy="priority")
    s.add_request(make_request("low", 4, arrival=0, priority=9))
    s.add_request(make_request("high", 4, arrival=1, priority=1))
    assert list(run_step(s).num_scheduled_tokens) == ["high"]


def test_swap_preemption_moves_blocks_to_cpu_and_back() -> None:
    s = make_scheduler(num_blocks=6, cpu_blocks=8, preemption_mode="swap")
    a, b = (
        make_request("a", 8, max_tokens=8, arrival=0),
        make_request("b", 8, max_tokens=8, arrival=1),
    )
    s.add_request(a)
    s.add_request(b)
    swapped_out = swapped_in = 0
    while s.has_unfinished_requests():
        out = run_step(s)
        swapped_out += len(out.blocks_to_swap_out)
        swapped_in += len(out.blocks_to_swap_in)
        # Never swap in and out in the same step (CPU blocks freed by one could feed the other).
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in)
        s.block_manager.check_integrity()
    assert swapped_out > 0 and swapped_in == swapped_out
    assert b.num_preemptions >= 1 and b.output_token_ids == [7] * 8
    assert len(s.block_manager.free_cpu_blocks) == 8


def test_abort_frees_blocks_and_reports_id_to_workers() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 9, max_tokens=8))
    run_step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.block_manager.num_free_blocks == 64
    assert s.schedule().finished_req_ids == ["a"]


def test_abort_of_waiting_request_removes_it_from_queue() -> None:
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4))
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 1 and "b" not in s.requests


def test_running_requests_are_sent_as_deltas() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 3, max_tokens=8))
    out1 = s.schedule()
    msg1 = make_execute_model_request(out1)
    assert msg1.scheduled_new_reqs[0].prompt_token_ids == [100, 101, 102]
    assert not msg1.scheduled_cached_reqs
    s.update_from_output(out1, ["a"], [[7]])
    msg2 = make_execute_model_request(s.schedule())
    assert not msg2.scheduled_new_reqs
    delta = msg2.scheduled_cached_reqs[0]
    # The 4th token still fits in the first block: only the sampled token travels.
    assert (delta.new_token_ids, delta.new_block_ids, delta.num_computed_tokens) == ([7], [], 3)


def test_disable_chunked_mm_input_stops_a_chunk_before_an_image_it_would_split() -> None:
    s = make_scheduler(budget=8, disable_chunked_mm_input=True)
    image = image_feature(np.zeros((3, 2, 2), np.float32), offset=5, length=6)
    s.add_request(
        Request("a", list(range(100, 120)), SamplingParams(), max_tokens=4, mm_features=[image])
    )
    # [0, 5) stops before the image, [5, 13) holds it whole, then the rest of the text.
    assert [run_step(s).num_scheduled_tokens["a"] for _ in range(3)] == [5, 8, 7]
    plain = make_scheduler(budget=8)
    plain.add_request(
        Request("b", list(range(100, 120)), SamplingParams(), max_tokens=4, mm_features=[image])
    )
    assert [run_step(plain).num_scheduled_tokens["b"] for _ in range(3)] == [8, 8, 4]
