"""The pooling half of ``LLMServer`` (mixed into it): ``embed`` (one input's embedding, or its
class probabilities and label for ``classify``) and ``score`` (text pairs, as
``engine.client.scoring`` scores them: a cross-encoder's class probability of each pair, or the
cosine of a bi-encoder's two embeddings). The ingress's ``/v1/embeddings``, ``/classify``,
``/score`` and ``/rerank`` call them; errors are ``StreamError`` items of the same table as
generation's (400 naming the field, 503 overloaded, draining or engine dead)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from cluster.api.replica_messages import (
    EmbedRequest,
    EmbedResult,
    ScoreRequest,
    ScoreResult,
    StreamError,
)
from engine.client.scoring import cosine, pair_prompt, score_pairs, single_class
from engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStateError,
    InvalidRequestError,
    RequestAbortedError,
)
from engine.model_heads import label_names, num_labels, pair_uses_sep_token
from engine.outputs import PoolingRequestOutput
from engine.pooling_params import PoolingParams

logger = logging.getLogger("llm_cluster.serve")

_REFUSED = (InvalidRequestError, EngineOverloadedError, RequestAbortedError, EngineStateError,
            EngineDeadError)  # fmt: skip


class PoolingServer:
    """``embed`` and ``score`` over ``LLMServer``'s engine, tokenizer and request tracking."""

    engine: Any
    config: Any
    metrics: Any  # cluster.serving.metrics.ModelMetrics
    tokenizer: Any
    model_id: str
    draining: bool
    drain_aborted: bool
    _active: set[str]
    _ensure_stats_task: Any
    _draining_error: Any
    _refusal: Any
    _prompt: Any
    _ensure_awake: Any

    async def embed(self, request: EmbedRequest) -> EmbedResult | StreamError:
        """One input pooled by the engine's ``pooling_type``: its embedding (task ``embed``)
        or its class probabilities and the likeliest class's name (task ``classify``)."""
        params_of = {
            "task": request.task,
            "normalize": request.normalize,
            "dimensions": request.dimensions,
            "activation": request.activation,
        }
        try:
            params = PoolingParams(**params_of)
            prompt = self._prompt(request)
        except InvalidRequestError as exc:
            return self._refusal(exc)
        outputs = await self._pool([prompt], params, request.request_id)
        if isinstance(outputs, StreamError):
            return outputs
        (output,) = outputs
        vector = _vector(output)
        label = None
        if params.task == "classify":
            label = label_names(self.config.model.hf_config)[vector.index(max(vector))]
        return EmbedResult(vector, len(output.prompt_token_ids), label)

    async def score(self, request: ScoreRequest) -> ScoreResult | StreamError:
        """One score per pair of ``request``, in order (0..1 for a cross-encoder, -1..1 for
        a cosine)."""
        try:
            pairs = score_pairs(request.text_1, request.text_2)
            model = self.config.model
            if model.task == "classify":
                single_class(num_labels(model.hf_config), self.model_id)
        except InvalidRequestError as exc:
            return self._refusal(exc)
        if model.task == "classify":
            sep = pair_uses_sep_token(model.hf_config)
            prompts = [pair_prompt(self.tokenizer, a, b, sep) for a, b in pairs]
            outputs = await self._pool(prompts, PoolingParams(task="classify"), request.request_id)
            if isinstance(outputs, StreamError):
                return outputs
            return ScoreResult([_vector(o)[0] for o in outputs], _tokens(outputs))
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        prompts = [self._prompt(EmbedRequest(prompt=t)) for t in texts]
        outputs = await self._pool(prompts, PoolingParams(task="embed"), request.request_id)
        if isinstance(outputs, StreamError):
            return outputs
        vectors = {t: _vector(o) for t, o in zip(texts, outputs, strict=True)}
        # Each text is embedded once, but usage counts every text of the request (one text_1
        # against many: once), as vLLM bills it.
        counts = {t: len(o.prompt_token_ids) for t, o in zip(texts, outputs, strict=True)}
        tokens = sum(counts[t] for t in (*request.text_1, *request.text_2))
        return ScoreResult([cosine(vectors[a], vectors[b]) for a, b in pairs], tokens)

    async def _pool(
        self, prompts: list[Any], params: PoolingParams, request_id: str
    ) -> list[PoolingRequestOutput] | StreamError:
        """Every prompt through the engine at once (request ids ``<id>`` or ``<id>-<i>``);
        the first refusal cancels the rest (which aborts them) and is returned."""
        self._ensure_stats_task()
        if self.draining:
            return self._draining_error()
        ids = [request_id]
        if len(prompts) > 1:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._active.update(ids)
        tasks: list[asyncio.Future[PoolingRequestOutput]] = []
        start = time.monotonic()

        async def encode(prompt: Any, rid: str) -> PoolingRequestOutput:
            output = await self.engine.encode(prompt, params, rid)
            self.metrics.on_pooled(start, time.monotonic())
            return output

        try:
            await self._ensure_awake()
            if self.drain_aborted:  # the drain's abort came before the engine had them
                return self._draining_error()
            tasks = [
                asyncio.ensure_future(encode(p, rid)) for p, rid in zip(prompts, ids, strict=True)
            ]
            return list(await asyncio.gather(*tasks))
        except _REFUSED as exc:
            if isinstance(exc, EngineDeadError):
                logger.exception("model %s: pooling failed, the engine is dead", self.model_id)
            return self._refusal(exc)
        finally:
            for task in tasks:
                task.cancel()
            self._active.difference_update(ids)


def _vector(output: PoolingRequestOutput) -> list[float]:
    # encode returns only finished outputs with a vector (an abort raises).
    if output.outputs is None:
        raise RuntimeError(f"{output.request_id!r}: a finished pooling output without data")
    return output.outputs.data


def _tokens(outputs: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outputs)


__all__ = ["PoolingServer"]
