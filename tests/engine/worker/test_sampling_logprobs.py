"""Logprobs and prompt logprobs equal HF transformers' log_softmax of the logits (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source

TOP = 5
TOL = 1e-4


def _hf_logprobs(arch: str, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: row t = log_softmax of HF's logits after token_ids[: t + 1]."""
    path = resolve_model_source(f"builtin:{arch}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def _assert_matches(entry: dict, hf_row: torch.Tensor, chosen: int) -> None:
    top_lp, top_ids = hf_row.topk(TOP)
    assert next(iter(entry)) == chosen
    assert set(entry) == {chosen, *top_ids.tolist()}
    assert entry[chosen].logprob == pytest.approx(hf_row[chosen].item(), abs=TOL)
    # The rank as HF's, up to tokens within TOL of the chosen one (an fp32 rounding apart, a
    # tie may order either way).
    gap = hf_row - hf_row[chosen]
    above, tied = gap > TOL, gap.abs() <= TOL
    assert int(above.sum()) + 1 <= entry[chosen].rank <= int(above.sum() + tied.sum())
    for rank, (token, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
        assert entry[token].logprob == pytest.approx(lp, abs=TOL)
        if token != chosen:
            assert entry[token].rank == rank


# The 70-token prompt is longer than every window of the families (24 to 64 positions).
@pytest.fixture(
    scope="module",
    params=["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3",
            "tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-glm4-moe", "tiny-gpt-oss"],
)  # fmt: skip
def run(request: pytest.FixtureRequest) -> tuple[str, list[int], object]:
    arch = request.param
    # A small token budget chunks the 70-token prompt over three steps.
    llm = LLM(f"builtin:{arch}", num_kv_blocks=64, max_num_batched_tokens=32)
    # Seed 11 put two of tiny-deepseek-v3's biased expert scores one fp32 ulp apart (either
    # routing is right within rounding); with 16 the DeepSeek models' smallest routing margin
    # (k-th vs (k+1)-th expert or group, prompt and completion) is above 5e-4.
    rng = random.Random(16)
    prompt = [rng.randrange(llm.llm_engine.config.model.vocab_size) for _ in range(70)]
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP
    )
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return arch, prompt, out


def test_sampled_logprobs_and_top5_equal_hf(run) -> None:
    arch, prompt, out = run
    completion = out.outputs[0]
    hf = _hf_logprobs(arch, prompt + completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids) == 12
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = hf[len(prompt) - 1 + j]
        assert token == row.argmax().item()
        _assert_matches(entry, row, token)
    expected_cumulative = sum(
        hf[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion.token_ids)
    )
    assert completion.cumulative_logprob == pytest.approx(expected_cumulative, abs=12 * TOL)


def test_prompt_logprobs_equal_hf_across_prefill_chunks(run) -> None:
    arch, prompt, out = run
    hf = _hf_logprobs(arch, prompt)
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
        _assert_matches(out.prompt_logprobs[t], hf[t - 1], prompt[t])


def test_logprobs_zero_returns_only_the_sampled_token() -> None:
    llm = LLM("builtin:tiny-llama", num_kv_blocks=32)
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]},
        SamplingParams(temperature=0, max_tokens=3, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    assert [list(e) for e in out.logprobs] == [[t] for t in out.token_ids]
    tokenizer = llm.get_tokenizer()
    # vLLM's: a token that ends inside a UTF-8 character (here the first, a byte no later token
    # finishes) has the text "".
    texts = [tokenizer.decode([t]) for t in out.token_ids]
    assert [e[t].decoded_token for e, t in zip(out.logprobs, out.token_ids)] == [
        "" if text.endswith("\ufffd") else text for text in texts
    ]
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids))
    )


def test_no_logprobs_asked_means_none_returned() -> None:
    llm = LLM("builtin:tiny-llama", num_kv_blocks=32)
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None
