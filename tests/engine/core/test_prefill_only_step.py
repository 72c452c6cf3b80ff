"""A step in which no request reaches the end of its prompt samples nothing (and must not fail)."""

from __future__ import annotations

from engine import LLM, SamplingParams

LONG_PROMPT = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen"
)
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_lone_long_prompt_chunked_over_several_steps_equals_unchunked() -> None:
    unchunked = LLM("builtin:tiny-llama", num_kv_blocks=32, device="cpu")
    expected = unchunked.generate(LONG_PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # An 8-token budget: the first steps compute only prompt chunks, with no row to sample.
    chunked = LLM("builtin:tiny-llama", num_kv_blocks=32, device="cpu", max_num_batched_tokens=8)
    assert len(chunked.get_tokenizer().encode(LONG_PROMPT)) > 2 * 8
    assert chunked.generate(LONG_PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
