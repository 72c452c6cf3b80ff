"""What a step's hidden states become on the driver besides the sampled tokens, and the
sampler's per-request inputs: the sampling metadata of the rows that sample, each request's
logprob lists, the raw logprobs of prompt tokens a chunk scores (``prompt_logprobs``), and the
pooled vectors of pooling requests (``pool_rows``: a running mean across chunks, or the last
token; then the request's task head). The model runner (``engine.worker.model_runner``) calls
them after the forward pass; the request states are its ``CachedRequestState``s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.pooling_params import PoolingParams
from engine.worker.sampler import LogprobsTensors, SamplingMetadata, gather_logprobs
from engine.worker.step_inputs import CachedRequestState
from engine.worker.step_messages import LogprobsLists, PromptLogprobs


def sampling_metadata(
    states: Sequence[CachedRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """The sampler's inputs for these requests' rows (token history only where a penalty,
    bad words or ``min_tokens`` needs it)."""
    params = [s.sampling_params for s in states]
    needs_history = any(p.has_penalties or p.bad_words_token_ids or p.min_tokens for p in params)
    return SamplingMetadata.build(
        params,
        [s.generator for s in states],
        vocab_size,
        device,
        prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states]
        if needs_history
        else None,
        output_token_ids=[s.output_token_ids for s in states] if needs_history else None,
        eos_token_ids=[s.eos_token_ids for s in states],
    )


def split_logprobs(
    tensors: LogprobsTensors, num_logprobs: list[int | None]
) -> list[LogprobsLists | None]:
    """One row per request, trimmed to the k it asked for (None where it asked for none)."""
    token_ids, lps, ranks = (
        tensors.token_ids.tolist(),
        tensors.logprobs.tolist(),
        tensors.ranks.tolist(),
    )
    return [
        None
        if k is None
        else LogprobsLists(
            token_ids=[token_ids[i][: k + 1]], logprobs=[lps[i][: k + 1]], ranks=[ranks[i]]
        )
        for i, k in enumerate(num_logprobs)
    ]


def prompt_logprobs(
    model: nn.Module,
    requests: Mapping[str, CachedRequestState],
    rows: list[tuple[str, int, np.ndarray]],
    hidden: torch.Tensor,
    vocab_size: int,
) -> dict[str, PromptLogprobs]:
    """Raw logprobs of the prompt tokens this step's chunks score (``rows``: request id, first
    position, hidden-state rows). Every TP rank joins the logits gather; only rank 0 gets a
    result."""
    device = hidden.device
    packed = np.concatenate([r for _, _, r in rows])
    logits = model.compute_logits(hidden[torch.from_numpy(packed).to(device)])
    if logits is None:
        return {}
    targets, ks = [], []
    for rid, first, req_rows in rows:
        state = requests[rid]
        targets.extend(state.token_ids[first : first + len(req_rows)])
        ks.append(state.sampling_params.prompt_logprobs or 0)
    raw = logits.to(torch.float32).log_softmax(dim=-1)
    chosen = torch.tensor(targets, dtype=torch.int64, device=device)
    tensors = gather_logprobs(raw, chosen, min(max(ks), vocab_size))
    token_ids, lps, ranks = (
        tensors.token_ids.tolist(),
        tensors.logprobs.tolist(),
        tensors.ranks.tolist(),
    )
    result, offset = {}, 0
    for (rid, first, req_rows), k in zip(rows, ks):
        span = slice(offset, offset + len(req_rows))
        result[rid] = PromptLogprobs(
            start=first,
            lists=LogprobsLists(
                token_ids=[t[: k + 1] for t in token_ids[span]],
                logprobs=[lp[: k + 1] for lp in lps[span]],
                ranks=ranks[span],
            ),
        )
        offset += len(req_rows)
    return result


@torch.inference_mode()
def pool_rows(
    model: nn.Module,
    requests: Mapping[str, CachedRequestState],
    rows: list[tuple[str, int, np.ndarray, bool]],
    hidden: torch.Tensor,
    pooling_type: str,
) -> dict[str, list[float]]:
    """Driver only: fold this step's rows into each pooling request's state (``rows``: request
    id, first position, hidden-state rows, whether its prompt ends here); the vectors of the
    requests whose prompt this step finished."""
    packed = np.concatenate([r for _, _, r, _ in rows])
    gathered = hidden[torch.from_numpy(packed).to(hidden.device)].to(torch.float32)
    pooled: dict[str, list[float]] = {}
    offset = 0
    for rid, first, req_rows, finishes in rows:
        state = requests[rid]
        part = gathered[offset : offset + len(req_rows)]
        offset += len(req_rows)
        if pooling_type == "mean":
            chunk_sum = part.sum(dim=0)
            state.pooled_sum = (
                chunk_sum if state.pooled_sum is None else state.pooled_sum + chunk_sum
            )
            state.num_pooled = first + len(req_rows)
            if not finishes:
                continue
            vector = state.pooled_sum / state.num_pooled
        else:
            vector = part[-1]
        pooled[rid] = pooling_head(model, vector, state.pooling_params).tolist()
    return pooled


def pooling_head(
    model: nn.Module, vector: torch.Tensor, params: PoolingParams | None
) -> torch.Tensor:
    """A pooled vector as its request's task returns it: class scores, or the embedding
    (truncated to ``dimensions``, then normalised)."""
    params = params or PoolingParams()
    if params.task == "classify":
        logits = model.classify_hidden(vector[None])[0]
        return model.class_scores(logits) if params.activation else logits
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    return F.normalize(vector, dim=0) if params.normalize else vector
