"""Sampler filters and seeds against direct computations on known logits."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.worker.sampler import SamplingMetadata, apply_top_k_top_p, sample

LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])


def _meta(params: list[SamplingParams], seeds: bool = False) -> SamplingMetadata:
    gens = []
    for p in params:
        g = None
        if seeds and p.seed is not None:
            g = torch.Generator().manual_seed(p.seed)
        gens.append(g)
    return SamplingMetadata.build(params, gens, vocab_size=5, device=torch.device("cpu"))


def test_greedy_is_argmax() -> None:
    meta = _meta([SamplingParams(temperature=0)] * 2)
    assert sample(LOGITS, meta).token_ids.tolist() == [0, 4]


def test_top_k_keeps_exactly_k_per_row() -> None:
    out = apply_top_k_top_p(LOGITS.clone(), torch.tensor([2, 5]), None)
    assert torch.isinf(out[0]).tolist() == [False, False, True, True, True]
    assert not torch.isinf(out[1]).any()


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = LOGITS[0].softmax(-1)  # ~[0.636, 0.234, 0.086, 0.032, 0.012]
    out = apply_top_k_top_p(LOGITS[:1].clone(), None, torch.tensor([0.8]))
    kept = (~torch.isinf(out[0])).tolist()
    assert kept == [True, True, False, False, False]
    assert probs[0] < 0.8 <= probs[0] + probs[1]


def test_top_p_always_keeps_the_top_token() -> None:
    out = apply_top_k_top_p(LOGITS[:1].clone(), None, torch.tensor([0.01]))
    assert (~torch.isinf(out[0])).tolist() == [True, False, False, False, False]


def test_sampling_frequencies_follow_temperature_scaled_softmax() -> None:
    torch.manual_seed(0)
    params = [SamplingParams(temperature=2.0)] * 4000
    logits = LOGITS[:1].expand(4000, 5).contiguous()
    counts = torch.bincount(sample(logits, _meta(params)).token_ids, minlength=5).float() / 4000
    expected = (LOGITS[0] / 2.0).softmax(-1)
    assert torch.allclose(counts, expected, atol=0.03)


def test_seeded_row_does_not_depend_on_other_rows() -> None:
    seeded = SamplingParams(temperature=1.0, seed=99)
    alone = [sample(LOGITS[:1], _meta([seeded], seeds=True)).token_ids.item() for _ in range(1)]
    meta = _meta([SamplingParams(temperature=1.0), seeded], seeds=True)
    batched = sample(torch.stack([LOGITS[1], LOGITS[0]]), meta).token_ids[1].item()
    assert alone[0] == batched
