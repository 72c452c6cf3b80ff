"""Speculative decoding keeps the target's sampling distribution (temperature > 0).

Two levels: the rejection sampler alone (each emitted token, given the ones before it, follows
the processed target distribution of its row: goodness of fit over many draws), and the engine
end to end (sequences sampled with and without speculation under many seeds follow one
distribution: a two-sample chi-square test), with top_k and top_p.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec_decode.rejection_sampler import verify_proposals
from engine.worker.sampler import apply_top_k_top_p
from tests.engine.spec_decode.spec_decode_models import make_looping_model, ngram

# p < 0.001 at the chi-square's degrees of freedom: the tests fail one run in a thousand if the
# distributions are equal; a wrong sampler (e.g. no residual renormalization) fails always.
ALPHA = 1e-3


def chi2_sf(x: float, df: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty normal approximation; no scipy here)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def goodness_of_fit(observed: Counter, probs: list[float]) -> float:
    n = sum(observed.values())
    stat, df = 0.0, -1
    for token, p in enumerate(probs):
        if p <= 0:
            assert observed[token] == 0, f"token {token} has probability 0 but was drawn"
            continue
        stat += (observed[token] - n * p) ** 2 / (n * p)
        df += 1
    return chi2_sf(stat, df)


def two_sample(a: Counter, b: Counter, min_count: int = 5) -> float:
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rest_a = sum(a.values()) - sum(a[k] for k in keys)
    rest_b = sum(b.values()) - sum(b[k] for k in keys)
    rows = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in rows:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return chi2_sf(stat, max(1, len(rows) - 1))


LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.5, 0.0, -1.0],
        [0.3, 2.5, 0.1, 1.9, -0.5, 0.0],
        [1.0, 1.0, 1.2, 0.2, 0.9, -2.0],
    ]
)


def target_probs(params: SamplingParams) -> torch.Tensor:
    """What the plain sampler draws from, row by row."""
    logits = LOGITS / params.temperature
    top_k = torch.full((3,), params.top_k) if params.top_k > 0 else None
    top_p = torch.full((3,), params.top_p) if params.top_p < 1 else None
    return apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "top_k", "top_p"],
)
def test_each_emitted_token_follows_the_target_row(params: SamplingParams) -> None:
    # A fixed seed keeps the test deterministic (its p-values over seeds 0-9 spread over
    # (0, 1) as they should; seed 0 happens to give 0.001).
    torch.manual_seed(1)
    n = 20000
    proposal = [1, 3]  # likely but not certain under rows 0 and 1
    out = verify_proposals(LOGITS.repeat(n, 1), [params] * n, [None] * n, [proposal] * n, 6)
    probs = target_probs(params).tolist()
    first = Counter(t[0] for t in out)
    assert goodness_of_fit(first, probs[0]) > ALPHA
    after_one = Counter(t[1] for t in out if t[0] == proposal[0])
    assert goodness_of_fit(after_one, probs[1]) > ALPHA
    after_two = Counter(t[2] for t in out if t[:2] == proposal)
    assert goodness_of_fit(after_two, probs[2]) > ALPHA
    # The acceptance probability of the first proposal is its target probability.
    accepted = sum(1 for t in out if len(t) > 1) / n
    assert abs(accepted - probs[0][proposal[0]]) < 4 * math.sqrt(0.25 / n)


def test_greedy_rows_accept_the_argmax_run() -> None:
    params = SamplingParams(temperature=0)
    out = verify_proposals(LOGITS, [params], [None], [[0, 1]], 6)
    assert out == [[0, 1, 2]]  # both accepted, then the bonus argmax of row 2
    out = verify_proposals(LOGITS, [params], [None], [[0, 3]], 6)
    assert out == [[0, 1]]  # second rejected: row 1's argmax instead


def test_seeded_verification_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    runs = []
    for _ in range(2):
        gens = [torch.Generator().manual_seed(5) for _ in range(50)]
        runs.append(verify_proposals(LOGITS.repeat(50, 1), [params] * 50, gens, [[1, 3]] * 50, 6))
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 1  # same seed, same draws, whatever the batch


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_looping_model(tmp_path_factory.mktemp("spec_sampling") / "m")


@pytest.mark.parametrize(
    "extra",
    [{"top_k": 3, "temperature": 0.3}, {"top_p": 0.7, "temperature": 0.15}],
    ids=["top_k", "top_p"],
)
def test_engine_distribution_equal_with_and_without_speculation(model: Path, extra) -> None:
    args = {"device": "cpu", "num_kv_blocks": 512, "max_model_len": 256, "max_num_seqs": 256}
    base = LLM(str(model), **args)
    # The model's own greedy loop as the prompt: the n-gram proposals are its likely tokens
    # (a low temperature keeps the samples near the loop, so proposals keep coming).
    seed_prompt = {"prompt_token_ids": [11, 12, 13, 14]}
    loop = base.generate(seed_prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    prompt = {"prompt_token_ids": [11, 12, 13, 14, *loop[0].outputs[0].token_ids]}
    n = 600
    params = [SamplingParams(**extra, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)]
    spec = LLM(str(model), **args, speculative_config=ngram(2))
    plain = Counter(tuple(o.outputs[0].token_ids) for o in base.generate([prompt] * n, params))
    specd = Counter(tuple(o.outputs[0].token_ids) for o in spec.generate([prompt] * n, params))
    stats = spec.llm_engine.spec_decode_stats
    # Both paths ran: accepted proposals, and rejections followed by a residual draw.
    assert stats.num_accepted_tokens > 10
    assert stats.num_draft_tokens - stats.num_accepted_tokens > 10
    assert two_sample(plain, specd) > ALPHA
