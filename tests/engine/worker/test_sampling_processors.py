"""Each logits processor changes the distribution exactly as its definition says, checked
against a direct computation on known logits; seeds make sampling reproducible."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.sampler import SamplingMetadata, gather_logprobs, process_logits, sample

VOCAB = 6
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])


def _meta(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    eos: list[list[int]] | None = None,
) -> SamplingMetadata:
    return SamplingMetadata.build(
        params,
        [None] * len(params),
        VOCAB,
        torch.device("cpu"),
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        eos_token_ids=eos,
    )


def _process(params: SamplingParams, **history: list[list[int]]) -> list[float]:
    return process_logits(LOGITS.clone(), _meta([params], **history))[0].tolist()


def test_presence_penalty_subtracts_once_per_generated_token() -> None:
    got = _process(SamplingParams(presence_penalty=1.5), outputs=[[3, 3, 0]], prompts=[[5]])
    expected = LOGITS[0].tolist()
    expected[3] -= 1.5
    expected[0] -= 1.5
    assert got == pytest.approx(expected)


def test_frequency_penalty_subtracts_per_occurrence() -> None:
    got = _process(SamplingParams(frequency_penalty=0.5), outputs=[[3, 3, 0]], prompts=[[5]])
    expected = LOGITS[0].tolist()
    expected[3] -= 2 * 0.5
    expected[0] -= 0.5
    assert got == pytest.approx(expected)


def test_negative_presence_penalty_encourages_repetition() -> None:
    got = _process(SamplingParams(presence_penalty=-2.0), outputs=[[1]])
    assert got[1] == pytest.approx(LOGITS[0, 1].item() + 2.0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    got = _process(SamplingParams(repetition_penalty=2.0), outputs=[[0, 1]], prompts=[[4, 5]])
    # seen: 0 (+2.0), 1 (-1.0), 4 (-2.0), 5 (+1.0); unseen 2, 3 unchanged
    assert got == pytest.approx([1.0, -2.0, 0.5, 3.0, -4.0, 0.5])


def test_penalties_leave_unseen_tokens_and_other_rows_alone() -> None:
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    logits = LOGITS.expand(2, VOCAB).clone()
    got = process_logits(logits, _meta(params, outputs=[[2], [2]], prompts=[[], []]))
    assert got[1].tolist() == LOGITS[0].tolist()
    assert got[0, 2].item() == pytest.approx(LOGITS[0, 2].item() - 1.0)


def test_logit_bias_adds_to_the_named_tokens() -> None:
    got = _process(SamplingParams(logit_bias={1: 5.0, 4: -100.0}))
    expected = LOGITS[0].tolist()
    expected[1] += 5.0
    expected[4] -= 100.0
    assert got == pytest.approx(expected)


def test_allowed_token_ids_mask_every_other_token_of_their_rows_only() -> None:
    params = [SamplingParams(allowed_token_ids=[1, 4]), SamplingParams(),
              SamplingParams(allowed_token_ids=[5, 5])]  # fmt: skip
    logits = LOGITS.expand(3, VOCAB).clone()
    got = process_logits(logits, _meta(params))
    inf = float("-inf")
    assert got[0].tolist() == [inf, -1.0, inf, inf, -2.0, inf]
    assert got[1].tolist() == LOGITS[0].tolist()
    assert got[2].tolist() == [inf] * 5 + [1.0]
    # Greedy takes the best allowed token; a draw never leaves the allowed ones.
    greedy = [SamplingParams(temperature=0, allowed_token_ids=[1, 4])] * 3
    assert sample(logits, _meta(greedy)).token_ids.tolist() == [1, 1, 1]
    hot = [SamplingParams(temperature=2.0, allowed_token_ids=[1, 4])] * 400
    drawn = sample(LOGITS.expand(400, VOCAB).clone(), _meta(hot)).token_ids
    assert set(drawn.tolist()) == {1, 4}


def test_single_token_bad_word_is_always_banned() -> None:
    got = _process(SamplingParams(bad_words_token_ids=[[3]]), outputs=[[]])
    assert got[3] == float("-inf")
    assert [v for i, v in enumerate(got) if i != 3] == [
        v for i, v in enumerate(LOGITS[0].tolist()) if i != 3
    ]


def test_multi_token_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    params = SamplingParams(bad_words_token_ids=[[1, 2, 5]])
    assert _process(params, outputs=[[0, 1, 2]])[5] == float("-inf")
    assert _process(params, outputs=[[1, 0, 2]])[5] == LOGITS[0, 5].item()
    assert _process(params, outputs=[[2]])[5] == LOGITS[0, 5].item()
    assert _process(params, outputs=[[]])[5] == LOGITS[0, 5].item()


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[2])
    early = _process(params, outputs=[[0]], eos=[[3]])
    assert early[2] == early[3] == float("-inf")
    assert early[0] == LOGITS[0, 0].item()
    reached = _process(params, outputs=[[0, 1]], eos=[[3]])
    assert reached == LOGITS[0].tolist()


def test_min_tokens_with_ignore_eos_masks_only_stop_tokens() -> None:
    got = _process(
        SamplingParams(min_tokens=1, stop_token_ids=[2], ignore_eos=True), outputs=[[]], eos=[[3]]
    )
    assert got[2] == float("-inf") and got[3] == LOGITS[0, 3].item()


def test_greedy_follows_the_processed_logits() -> None:
    params = SamplingParams(temperature=0, logit_bias={4: 10.0})
    assert sample(LOGITS, _meta([params])).token_ids.item() == 4


def test_min_p_keeps_exactly_tokens_above_min_p_times_top_prob() -> None:
    probs = LOGITS[0].softmax(-1)
    min_p = 0.3
    allowed = probs >= min_p * probs.max()
    params = [SamplingParams(temperature=1.0, min_p=min_p)] * 3000
    torch.manual_seed(0)
    drawn = sample(LOGITS.expand(3000, VOCAB).contiguous(), _meta(params)).token_ids
    freq = torch.bincount(drawn, minlength=VOCAB).float() / 3000
    assert (freq[~allowed] == 0).all()
    expected = torch.where(allowed, probs, 0.0)
    assert torch.allclose(freq, expected / expected.sum(), atol=0.03)


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    seeded = SamplingParams(temperature=0.9, seed=7, presence_penalty=0.3, min_p=0.01)

    def draw(params: list[SamplingParams], logits: torch.Tensor, row: int) -> list[int]:
        gens = [
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params
        ]
        meta = SamplingMetadata.build(
            params, gens, VOCAB, torch.device("cpu"), output_token_ids=[[1]] * len(params)
        )
        return [sample(logits, meta).token_ids[row].item() for _ in range(20)]

    alone = draw([seeded], LOGITS, 0)
    again = draw([seeded], LOGITS, 0)
    mixed = draw(
        [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0)],
        torch.cat([LOGITS.flip(-1), LOGITS, LOGITS * 2]),
        1,
    )
    assert alone == again == mixed
    assert len(set(alone)) > 1


def test_logprobs_are_the_raw_log_softmax_not_the_processed_one() -> None:
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={4: 10.0}, presence_penalty=2)
    out = sample(LOGITS, _meta([params], outputs=[[3]]))
    raw = LOGITS[0].log_softmax(-1)
    assert out.token_ids.item() == 4
    assert out.logprobs.token_ids[0].tolist() == [4, 3, 0]
    assert out.logprobs.logprobs[0].tolist() == pytest.approx(raw[[4, 3, 0]].tolist())
    assert out.logprobs.ranks.item() == 6


def test_a_token_tied_with_another_ranks_after_it_as_in_vllm() -> None:
    raw = torch.tensor([[1.0, 1.0, 0.5, 0.0]]).log_softmax(-1).repeat(3, 1)
    ranks = gather_logprobs(raw, torch.tensor([0, 2, 3]), 2).ranks
    assert ranks.tolist() == [2, 3, 4]  # vLLM's count of the tokens at least as likely


@pytest.mark.gpu
def test_processors_on_cuda_equal_cpu() -> None:
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.3),
        SamplingParams(logit_bias={2: 4.0}, bad_words_token_ids=[[0, 1], [5]], min_tokens=3),
        SamplingParams(allowed_token_ids=[0, 2, 3]),
    ]
    history = {"outputs": [[1, 1, 4], [0], []], "prompts": [[2, 3], [4], [1]],
               "eos": [[3], [3], [3]]}  # fmt: skip
    logits = torch.cat([LOGITS, LOGITS.flip(-1), LOGITS])
    cpu = process_logits(logits, _meta(params, **history))
    meta = SamplingMetadata.build(
        params,
        [None] * 3,
        VOCAB,
        torch.device("cuda"),
        prompt_token_ids=history["prompts"],
        output_token_ids=history["outputs"],
        eos_token_ids=history["eos"],
    )
    assert torch.equal(process_logits(logits.cuda(), meta).cpu(), cpu)
