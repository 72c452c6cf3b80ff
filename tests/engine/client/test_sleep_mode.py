"""Sleep mode (vLLM's ``LLM.sleep`` / ``wake_up``): level 1 frees the KV cache, level 2 the
weights too, each measured by the process's resident memory; after ``wake_up`` the engine
gives the same greedy tokens as before it slept; requests are refused while it sleeps; the
prefix cache is lost; a LoRA adapter works again after level 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin.catalog import make_tiny_lora
from engine.builtin.tiny_models import tiny_variant
from engine.errors import EngineSleepingError, EngineStateError, InvalidRequestError
from engine.lora_request import LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    {"prompt_token_ids": [5 + (7 * i + j) % 900 for j in range(40 + 9 * i)]} for i in range(3)
]
# tiny-llama: 2 layers x K and V x 2 KV heads x 16 x fp32 x 16 tokens = 8 KiB a block.
KV_BLOCKS = 24576  # 192 MiB of KV cache
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _commit_kv_cache(llm: LLM) -> None:
    """Write every KV block: a CPU cache's pages are committed only as blocks are first written
    (``engine.worker.zeroed_memory``), and a full cache is what a busy server holds."""
    for caches in llm.llm_engine.executor.worker.runner.cache_engine.group_caches:
        for cache in caches:
            cache.zero_()


def _tokens(llm: LLM, **options: Any) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, **options)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def wide_model() -> Path:
    """tiny-llama with a wide MLP: ~100 MiB of fp32 weights, enough to see them go."""
    return tiny_variant("tiny-llama", hidden_size=512, intermediate_size=8192)


def test_level_1_frees_the_kv_cache_and_wakes_to_the_same_tokens() -> None:
    llm = LLM("builtin:tiny-llama", dtype="float32", max_model_len=256, num_kv_blocks=KV_BLOCKS)
    before = _tokens(llm)
    _commit_kv_cache(llm)
    awake = _rss()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    freed = awake - _rss()
    assert freed > 0.8 * KV_BLOCKS * 8192, f"freed {freed / MIB:.1f} MiB of a 192 MiB cache"
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _tokens(llm) == before


def test_level_2_frees_the_weights_too_and_reloads_them_on_wake(wide_model: Path) -> None:
    llm = LLM(str(wide_model), dtype="float32", max_model_len=256, num_kv_blocks=64)
    before = _tokens(llm)
    weights = llm.llm_engine.executor.worker.parameter_bytes()
    assert weights > 90 * MIB
    awake = _rss()
    llm.sleep(level=2)
    freed = awake - _rss()
    assert freed > 0.8 * weights, f"freed {freed / MIB:.1f} MiB of {weights / MIB:.1f} MiB"
    llm.wake_up()
    assert _tokens(llm) == before


def test_a_sleeping_engine_refuses_requests_and_sleeps_only_idle() -> None:
    llm = LLM("builtin:tiny-llama", dtype="float32", max_model_len=256, num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(EngineStateError, match="1 requests are unfinished"):
        llm.sleep()
    engine.abort_request("busy")
    llm.sleep()
    with pytest.raises(EngineSleepingError, match="asleep"):
        engine.add_request("late", PROMPTS[0], GREEDY)
    with pytest.raises(EngineSleepingError):
        llm.sleep(level=2)
    llm.wake_up()
    assert len(_tokens(llm)) == len(PROMPTS)


def test_wake_up_by_tags_wakes_the_weights_before_the_cache() -> None:
    llm = LLM("builtin:tiny-llama", dtype="float32", max_model_len=256, num_kv_blocks=64)
    before = _tokens(llm)
    llm.sleep(level=2)
    with pytest.raises(InvalidRequestError, match="tags: the KV cache wakes after the weights"):
        llm.wake_up(tags=["kv_cache"])
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _tokens(llm) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"level": 3}, "level: must be one of"), ({"level": True}, "level: must be one of")],
)
def test_bad_sleep_arguments_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    llm = LLM("builtin:tiny-llama", dtype="float32", max_model_len=256, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match=message):
        llm.sleep(**kwargs)
    with pytest.raises(InvalidRequestError, match="tags: a non-empty list"):
        llm.wake_up(tags=["everything"])
    assert not llm.is_sleeping()


def test_the_prefix_cache_is_lost_with_the_kv_cache() -> None:
    llm = LLM("builtin:tiny-llama", dtype="float32", max_model_len=256, num_kv_blocks=64)
    manager = llm.llm_engine.block_manager
    _tokens(llm)
    _tokens(llm)
    assert manager.prefix_hits > 0
    hits = manager.prefix_hits
    llm.sleep(level=1)
    llm.wake_up()
    _tokens(llm)
    assert manager.prefix_hits == hits  # nothing cached survived the sleep
    manager.check_integrity()


def test_a_lora_adapter_serves_the_same_tokens_after_level_2(tmp_path: Path) -> None:
    adapter = make_tiny_lora("tiny-llama", tmp_path / "a", 8, ["q_proj", "v_proj"], seed=3)
    llm = LLM(
        "builtin:tiny-llama", dtype="float32", max_model_len=256, num_kv_blocks=64,
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    lora = LoRARequest("a", 1, str(adapter))
    before = _tokens(llm, lora_request=lora)
    assert before != _tokens(llm)
    llm.sleep(level=2)
    llm.wake_up()
    assert _tokens(llm, lora_request=lora) == before


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_on_a_gpu_sleep_frees_device_memory_and_wakes_to_the_same_tokens(
    wide_model: Path, level: int
) -> None:
    llm = LLM(str(wide_model), dtype="float32", device="cuda", max_model_len=256,
              num_kv_blocks=KV_BLOCKS)  # fmt: skip
    before = _tokens(llm)  # with CUDA graphs: they are captured again on wake
    weights = llm.llm_engine.executor.worker.parameter_bytes()
    awake = torch.cuda.memory_allocated()
    llm.sleep(level=level)
    freed = awake - torch.cuda.memory_allocated()
    # Level 1 moves the weights to host memory; both levels free the device's copy.
    assert freed > 0.8 * (KV_BLOCKS * 8192 + weights)
    llm.wake_up()
    assert _tokens(llm) == before
