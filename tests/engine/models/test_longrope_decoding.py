"""Decoding across longrope's original context (Phi-3-128k past 4096; tiny-phi3 past 512).

The engine rotates position p with the long factors iff p >= original_max_position_embeddings,
fixed per position, so chunked prefill, prefix caching and preemption never change a token's
rotation. That is exactly HF's model decoding with its KV cache (each step rotates with the
factors for seq_len = p + 1 and keeps the cached keys): the reference here. HF's ``generate``
differs on purpose at the crossing: Phi-3's ``prepare_inputs_for_generation`` drops the cache
once and re-prefills the whole sequence with the long factors; the last test shows it.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source

ORIGINAL = 512
PROMPT_LEN = 500
NEW_TOKENS = 40  # positions 500..539: the last 28 are rotated with the long factors


@pytest.fixture(scope="module")
def case() -> dict:
    path = resolve_model_source("builtin:tiny-phi3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.original_max_position_embeddings == ORIGINAL
    rng = random.Random(3)
    prompt = [rng.randrange(5, 1024) for _ in range(PROMPT_LEN)]
    expected, logprobs = [], []
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        logits = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        for _ in range(NEW_TOKENS):
            row = logits[0, -1].log_softmax(-1)
            token = int(row.argmax())
            expected.append(token)
            logprobs.append(float(row[token]))
            step = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            logits = step.logits
    return {"path": path, "hf": hf, "prompt": prompt, "tokens": expected, "logprobs": logprobs}


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 64}, {"enable_prefix_caching": True}],
    ids=["defaults", "chunked", "prefix_cached"],
)
def test_decoding_past_the_original_context_equals_hf_with_its_kv_cache(
    case: dict, engine_args: dict
) -> None:
    llm = LLM(str(case["path"]), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    runs = 2 if engine_args.get("enable_prefix_caching") else 1
    for _ in range(runs):  # the second run reads the prompt's blocks from the prefix cache
        out = llm.generate({"prompt_token_ids": case["prompt"]}, params, use_tqdm=False)[0]
        completion = out.outputs[0]
        assert completion.token_ids == case["tokens"]
        got = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        assert got == pytest.approx(case["logprobs"], abs=1e-4)


def test_hf_generate_reprefills_at_the_crossing_and_differs(case: dict) -> None:
    ids = torch.tensor([case["prompt"]])
    with torch.no_grad():
        out = case["hf"].generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    generated = out[0, PROMPT_LEN:].tolist()
    crossing = ORIGINAL - PROMPT_LEN  # the first token sampled after a position >= ORIGINAL
    assert generated[: crossing + 1] == case["tokens"][: crossing + 1]
    assert generated != case["tokens"]
