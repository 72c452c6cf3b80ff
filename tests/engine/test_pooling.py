"""Embeddings from the generative model: the prompt's final (post-norm) hidden states pooled
(last token or mean) and L2-normalised equal HF transformers' ``hidden_states[-1]`` pooled the
same way (fp32, same weights), under chunked prefill, mixed with generation, with prefix
caching and after preemption; nothing is left behind once they finish."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, ConfigError, EngineConfig, InvalidRequestError, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.client.async_llm_engine import AsyncLLMEngine
from engine.core.llm_engine import LLMEngine
from engine.errors import RequestAbortedError
from engine.outputs import PoolingRequestOutput
from engine.pooling_params import PoolingParams

ARCHS = ["tiny-llama", "tiny-qwen2"]
POOLING_TYPES = ["last", "mean"]
LENGTHS = [1, 5, 16, 17, 40, 100]
ATOL = 1e-5


class HFReference:
    """HF's final hidden states of a prompt, pooled like the engine pools them."""

    def __init__(self, arch: str) -> None:
        self.arch = arch
        path = resolve_model_source(f"builtin:{arch}")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.vocab = self.model.config.vocab_size

    def prompts(self, lengths: list[int], seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(self.vocab) for _ in range(n)] for n in lengths]

    @torch.no_grad()
    def embed(self, prompt: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
        out = self.model(torch.tensor([prompt]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0].to(torch.float32)  # post-norm in HF Llama / Qwen2
        vector = hidden[-1] if pooling_type == "last" else hidden.mean(dim=0)
        return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module", params=ARCHS)
def ref(request: pytest.FixtureRequest) -> HFReference:
    return HFReference(request.param)


@pytest.fixture(scope="module")
def llama() -> HFReference:
    return HFReference("tiny-llama")


def make_llm(arch: str, pooling_type: str, **engine_args: Any) -> LLM:
    args = {"dtype": "float32", "num_kv_blocks": 128, **engine_args}
    return LLM(f"builtin:{arch}", pooling_type=pooling_type, **args)


def assert_matches_hf(
    ref: HFReference,
    outputs: list[PoolingRequestOutput],
    prompts: list[list[int]],
    pooling_type: str,
    normalize: bool = True,
) -> None:
    for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        assert out.finished and out.finish_reason == "stop"
        assert out.prompt_token_ids == prompt
        got = torch.tensor(out.outputs.embedding)
        expected = ref.embed(prompt, pooling_type, normalize)
        assert torch.allclose(got, expected, atol=ATOL, rtol=0), (
            f"{ref.arch}/{pooling_type}: prompt {i} (len {len(prompt)}) differs by "
            f"{(got - expected).abs().max().item():.2e}"
        )


def assert_nothing_left(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert all(v == 0 for v in engine.request_state_sizes().values()), engine.request_state_sizes()
    stats = engine.get_kv_cache_stats()
    assert stats.free == stats.total, f"{stats.total - stats.free} blocks still held"
    assert engine.executor.collective_rpc("num_request_states") == [0]


def token_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


# ---- equal to HF ----------------------------------------------------------------------------


@pytest.mark.parametrize("pooling_type", POOLING_TYPES)
def test_batch_of_embeddings_equals_hf_hidden_states_pooled(
    ref: HFReference, pooling_type: str
) -> None:
    llm = make_llm(ref.arch, pooling_type)
    prompts = ref.prompts(LENGTHS)
    outputs = llm.embed(token_prompts(prompts), use_tqdm=False)
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    assert_matches_hf(ref, outputs, prompts, pooling_type)
    for out in outputs:
        assert sum(x * x for x in out.outputs.embedding) == pytest.approx(1.0, abs=1e-5)
    assert_nothing_left(llm.llm_engine)


@pytest.mark.parametrize("pooling_type", POOLING_TYPES)
def test_chunked_prefill_embeddings_equal_hf(ref: HFReference, pooling_type: str) -> None:
    # A 16-token budget: the 40- and 100-token prompts span 3 and 7 steps.
    llm = make_llm(ref.arch, pooling_type, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = ref.prompts(LENGTHS, seed=1)
    outputs = llm.embed(token_prompts(prompts), use_tqdm=False)
    assert_matches_hf(ref, outputs, prompts, pooling_type)
    assert_nothing_left(llm.llm_engine)


@pytest.mark.parametrize("pooling_type", POOLING_TYPES)
def test_normalize_false_returns_the_raw_pooled_vector(
    llama: HFReference, pooling_type: str
) -> None:
    llm = make_llm(llama.arch, pooling_type)
    prompts = llama.prompts([7, 33], seed=2)
    outputs = llm.embed(token_prompts(prompts), PoolingParams(normalize=False), use_tqdm=False)
    assert_matches_hf(llama, outputs, prompts, pooling_type, normalize=False)


def test_text_prompt_is_tokenized_like_generation(llama: HFReference) -> None:
    llm = make_llm(llama.arch, "last")
    out = llm.embed("The quick brown fox", use_tqdm=False)[0]
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("The quick brown fox")
    assert_matches_hf(llama, [out], [out.prompt_token_ids], "last")


# ---- alongside generation, prefix caching, preemption -------------------------------------


def run_to_completion(engine: LLMEngine) -> dict[str, Any]:
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.mark.parametrize("pooling_type", POOLING_TYPES)
def test_pooling_mixed_with_generation_leaves_tokens_unchanged(
    llama: HFReference, pooling_type: str
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    gen_prompts = llama.prompts([9, 50, 30], seed=3)
    alone = make_llm(llama.arch, pooling_type, max_num_batched_tokens=32)
    expected = [
        o.outputs[0].token_ids
        for o in alone.generate(token_prompts(gen_prompts), greedy, use_tqdm=False)
    ]

    llm = make_llm(llama.arch, pooling_type, max_num_batched_tokens=32)
    engine = llm.llm_engine
    pool_prompts = llama.prompts([70, 3, 45], seed=4)
    for i, prompt in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", {"prompt_token_ids": prompt}, greedy)
    engine.add_request("pool-0", {"prompt_token_ids": pool_prompts[0]}, PoolingParams())
    engine.step()
    engine.step()  # generation is decoding now; the next two join mid-flight
    engine.add_request("pool-1", {"prompt_token_ids": pool_prompts[1]}, PoolingParams())
    engine.add_request("pool-2", {"prompt_token_ids": pool_prompts[2]}, PoolingParams())
    finished = run_to_completion(engine)

    assert [finished[f"gen-{i}"].outputs[0].token_ids for i in range(3)] == expected
    pooled = [finished[f"pool-{i}"] for i in range(3)]
    assert_matches_hf(llama, pooled, pool_prompts, pooling_type)
    assert_nothing_left(engine)


def test_mean_pooling_skips_prefix_cache_hits_and_stays_equal(llama: HFReference) -> None:
    llm = make_llm(llama.arch, "mean", enable_prefix_caching=True)
    prompt = llama.prompts([100], seed=5)
    first = llm.embed(token_prompts(prompt), use_tqdm=False)
    second = llm.embed(token_prompts(prompt), use_tqdm=False)
    assert second[0].num_cached_tokens == 0
    assert second[0].outputs.embedding == first[0].outputs.embedding
    assert_matches_hf(llama, second, prompt, "mean")
    # A generation request with the same prompt still reuses the blocks it left cached.
    gen = llm.generate(token_prompts(prompt), SamplingParams(max_tokens=1), use_tqdm=False)
    assert gen[0].num_cached_tokens == 96
    assert_nothing_left(llm.llm_engine)


def test_last_pooling_uses_prefix_cache_hits_and_stays_equal(llama: HFReference) -> None:
    llm = make_llm(llama.arch, "last", enable_prefix_caching=True)
    prompt = llama.prompts([100], seed=5)
    llm.embed(token_prompts(prompt), use_tqdm=False)
    second = llm.embed(token_prompts(prompt), use_tqdm=False)
    assert second[0].num_cached_tokens == 96
    assert_matches_hf(llama, second, prompt, "last")
    assert_nothing_left(llm.llm_engine)


@pytest.mark.parametrize("pooling_type", POOLING_TYPES)
def test_pooling_after_recompute_preemption_equals_hf(
    llama: HFReference, pooling_type: str
) -> None:
    # 10 blocks of 16: an 80-token prompt decoding 60 tokens and a 100-token pooling prompt
    # cannot both fit, so the later (pooling) request is preempted mid-prompt and recomputed.
    llm = make_llm(
        llama.arch,
        pooling_type,
        num_kv_blocks=10,
        max_num_batched_tokens=32,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    gen_prompt, pool_prompt = llama.prompts([80, 100], seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("gen", {"prompt_token_ids": gen_prompt}, greedy)
    engine.add_request("pool", {"prompt_token_ids": pool_prompt}, PoolingParams())
    finished = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0, "the setting did not force preemption"
    assert_matches_hf(llama, [finished["pool"]], [pool_prompt], pooling_type)
    assert_nothing_left(engine)


# ---- errors, limits, abort ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_llm() -> LLM:
    return make_llm("tiny-llama", "mean", max_model_len=64)


def test_dimensions_is_rejected_naming_the_field(small_llm: LLM) -> None:
    engine = small_llm.llm_engine
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("dims", "hello", PoolingParams(dimensions=8))
    assert info.value.param == "dimensions"
    assert "does not support matryoshka representation" in str(info.value)
    assert not engine.has_unfinished_requests()
    assert_nothing_left(engine)


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"normalize": "yes"}, "normalize"), ({"dimensions": 1.5}, "dimensions")]
)
def test_pooling_params_types_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        PoolingParams(**kwargs)
    assert info.value.param == field


def test_prompt_may_fill_the_context_but_not_exceed_it(small_llm: LLM) -> None:
    out = small_llm.embed({"prompt_token_ids": [3] * 64}, use_tqdm=False)[0]
    assert len(out.outputs.embedding) == 64
    with pytest.raises(InvalidRequestError) as info:
        small_llm.embed({"prompt_token_ids": [3] * 65}, use_tqdm=False)
    assert info.value.param == "prompt"
    assert_nothing_left(small_llm.llm_engine)


def test_request_id_in_use_is_rejected(small_llm: LLM) -> None:
    engine = small_llm.llm_engine
    engine.add_request("same", [1, 2, 3], PoolingParams())
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("same", [1, 2, 3], SamplingParams())
    assert info.value.param == "request_id"
    run_to_completion(engine)
    assert_nothing_left(engine)


def test_abort_mid_prompt_frees_blocks_and_worker_state() -> None:
    llm = make_llm("tiny-llama", "mean", max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.add_request("abort-me", [5] * 100, PoolingParams())
    engine.step()
    assert engine.get_kv_cache_stats().used > 0
    (out,) = engine.abort_request("abort-me")
    assert isinstance(out, PoolingRequestOutput)
    assert (out.finished, out.finish_reason, out.outputs) == (True, "abort", None)
    assert_nothing_left(engine)


def test_pooling_type_engine_arg_is_validated_and_accepts_vllm_spelling() -> None:
    config = EngineConfig.from_kwargs(model="builtin:tiny-llama", pooling_type="MEAN")
    assert config.pooler.pooling_type == "mean"
    assert EngineConfig.from_kwargs(model="builtin:tiny-llama").pooler.pooling_type == "last"
    with pytest.raises(ConfigError, match=r"^pooling_type: "):
        EngineConfig.from_kwargs(model="builtin:tiny-llama", pooling_type="cls")


# ---- async front ----------------------------------------------------------------------------


def test_async_encode_equals_offline_and_hf(llama: HFReference) -> None:
    engine = AsyncLLMEngine.from_engine_args(
        model="builtin:tiny-llama", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16
    )
    prompts = llama.prompts([30, 4, 60], seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run() -> tuple[list[PoolingRequestOutput], list[int]]:
        async def generate() -> list[int]:
            items = [i async for i in engine.generate({"prompt_token_ids": prompts[0]}, greedy)]
            return items[-1].output.outputs[0].token_ids

        gen = asyncio.ensure_future(generate())
        outs = await asyncio.gather(
            *(engine.encode({"prompt_token_ids": p}, PoolingParams()) for p in prompts)
        )
        return list(outs), await gen

    try:
        outputs, tokens = asyncio.run(run())
        assert_matches_hf(llama, outputs, prompts, "last")
        offline = make_llm("tiny-llama", "last").generate(
            token_prompts(prompts[:1]), greedy, use_tqdm=False
        )
        assert tokens == offline[0].outputs[0].token_ids

        with pytest.raises(InvalidRequestError) as info:
            asyncio.run(engine.encode("hi", PoolingParams(dimensions=3)))
        assert info.value.param == "dimensions"

        asyncio.run(_cancel_before_it_finishes(engine))
        asyncio.run(_abort_before_it_finishes(engine))
        state = asyncio.run(_settled_state(engine))
        assert all(v == 0 for v in state["head"].values()), state
        assert state["workers"] == [0]
    finally:
        engine.shutdown()


async def _cancel_before_it_finishes(engine: AsyncLLMEngine) -> None:
    """Hold the core thread (commands run in order, between steps) so that the request is
    added but not stepped when its caller cancels."""
    before_add, after_add = threading.Event(), threading.Event()
    hold = asyncio.ensure_future(engine.call(lambda e: before_add.wait(10)))
    await asyncio.sleep(0.01)
    task = asyncio.ensure_future(engine.encode([7] * 50, PoolingParams(), "gone"))
    await asyncio.sleep(0.01)  # its add is queued behind the hold
    hold_again = asyncio.ensure_future(engine.call(lambda e: after_add.wait(10)))
    await asyncio.sleep(0.01)
    before_add.set()
    await asyncio.sleep(0.1)  # the add ran; the core waits again, before any step
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after_add.set()
    await asyncio.gather(hold, hold_again)


async def _abort_before_it_finishes(engine: AsyncLLMEngine) -> None:
    hold = threading.Event()
    held = asyncio.ensure_future(engine.call(lambda e: hold.wait(10)))
    await asyncio.sleep(0.01)
    task = asyncio.ensure_future(engine.encode([7] * 50, PoolingParams(), "aborted"))
    await asyncio.sleep(0.01)
    await engine.abort("aborted")  # queued behind the add: runs before any step
    hold.set()
    with pytest.raises(RequestAbortedError, match="'aborted' was aborted"):
        await task
    await held


async def _settled_state(engine: AsyncLLMEngine) -> dict[str, Any]:
    """Request state once an abort has reached the core and the workers (within a step)."""
    for _ in range(100):
        state = await engine.request_state()
        if all(v == 0 for v in state["head"].values()) and state["workers"] == [0]:
            return state
        await asyncio.sleep(0.05)
    return state
