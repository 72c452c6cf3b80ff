"""The pooling routes on the ingress, mixed into ``OpenAIIngress``: ``/v1/embeddings``
(OpenAI's), ``/classify``, ``/score`` and ``/rerank`` (vLLM's shapes; ``/rerank`` is Jina's and
Cohere's). Each fans its inputs out to the model's ``LLMServer`` (``embed`` per input,
``score`` per request: ``cluster.serving.pooling_server``) and shapes the reply; a
``StreamError`` from the server becomes its HTTP error. vLLM's pooling fields that would change
the output and are not supported (``use_activation: false``, ``embed_dtype``, ...) are 400s
naming them."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import msgspec
import numpy as np

from cluster.api.api_errors import APIError, api_error, renamed
from cluster.api.openai_models import EmbeddingRequest
from cluster.api.openai_payloads import (
    UNSUPPORTED_FIELDS,
    Unsupported,
    check_extra_fields,
    embedding_payloads,
)
from cluster.api.pooling_models import ClassificationRequest, RerankRequest, ScoreRequest
from cluster.api.replica_messages import ScoreRequest as ServerScoreRequest
from cluster.api.replica_messages import StreamError
from cluster.serving.ingress_calls import base_model, call_replica

# vLLM's pooling fields that change the output and are not supported (``check_extra_fields``),
# beside those of every route.
_POOLING_FIELDS = {
    **UNSUPPORTED_FIELDS,
    "use_activation": Unsupported("only true is supported (the model's activation, for "
                                  "embeddings the normalisation)", (True,)),
    "normalize": Unsupported("was removed (as in vLLM); only use_activation: true is supported"),
    "embed_dtype": Unsupported("only float32 is supported", ("float32",)),
    "endianness": Unsupported("only little-endian (native, little) is supported",
                              ("native", "little")),
    # Declared on /v1/embeddings and /classify: the pairs of /score and /rerank are not cut.
    "truncate_prompt_tokens": Unsupported("prompt truncation is not supported on this route"),
    "truncation_side": Unsupported("prompt truncation is not supported on this route"),
    "padding": Unsupported("only do_not_pad is supported", ("do_not_pad",)),
    "max_tokens_per_query": Unsupported("truncation is not supported; only 0 (none)", (0,)),
    "max_tokens_per_doc": Unsupported("truncation is not supported; only 0 (none)", (0,)),
    "instruction": Unsupported("score instructions are not supported"),
    "chat_template_kwargs": Unsupported("chat templates are not used on the pooling routes"),
}  # fmt: skip


def _encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list; ``base64``: little-endian float32 bytes in base64 (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _header(kind: str, model: str) -> dict[str, Any]:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list",
            "created": int(time.time()), "model": model}  # fmt: skip


class PoolingServicer:
    """The pooling routes over ``_route`` (``OpenAIIngress``'s, which mixes this in)."""

    _known_route: Any
    _admit: Any

    async def _server_of(self, model: str) -> Any:
        """The handle serving ``model``, resolved as the generate routes resolve it. The engine
        pools under the base model only: a LoRA adapter of it is a 400 (an unknown one a 404)."""
        handle, adapter = await self._known_route(model)
        if adapter is None:
            return handle
        raise APIError(400, f"`{model}` is a LoRA adapter of {base_model(model, adapter)!r}; the "
                       "pooling routes serve base models only (LoRA is not supported for "
                       "pooling)", "model")  # fmt: skip

    async def _call(
        self, model: str, calls: list[Awaitable[Any]], batch: str | None = None
    ) -> list[Any]:
        """The server replies of ``calls``, or the first error among them as an APIError.
        ``batch``: each call is item i of this request field (its error names ``batch.i``,
        not the server's ``prompt``)."""
        results = await call_replica(model, asyncio.gather(*calls))
        for i, result in enumerate(results):
            if isinstance(result, StreamError):
                error = api_error(result)
                if batch is not None:
                    name = f"{batch}.{i}"
                    error = renamed(error, (("prompt_token_ids", name), ("prompt", name)))
                raise error
        return list(results)

    async def embeddings(self, req: EmbeddingRequest) -> Any:
        check_extra_fields(req, _POOLING_FIELDS)
        handle = await self._server_of(req.model)
        await self._admit(req.model)
        inputs = embedding_payloads(req.input)
        changes = {"dimensions": req.dimensions, "add_special_tokens": req.add_special_tokens,
                   "truncate_prompt_tokens": req.truncate_prompt_tokens,
                   "truncation_side": req.truncation_side}  # fmt: skip
        inputs = [msgspec.structs.replace(p, **changes) for p in inputs]
        calls = [handle.embed.remote(p) for p in inputs]
        batch = isinstance(req.input, list) and not isinstance(req.input[0], int)
        try:
            results = await self._call(req.model, calls, "input" if batch else None)
        except APIError as exc:  # one input: the server names it prompt
            raise renamed(exc, (("prompt_token_ids", "input"), ("prompt", "input"))) from exc
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode_embedding(r.embedding, req.encoding_format)}
                for i, r in enumerate(results)]  # fmt: skip
        tokens = sum(r.prompt_tokens for r in results)
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip

    async def classify(self, req: ClassificationRequest) -> Any:
        check_extra_fields(req, _POOLING_FIELDS)
        handle = await self._server_of(req.model)
        inputs = embedding_payloads(req.input)  # text, token ids, or a batch of either
        await self._admit(req.model)
        changes = {"task": "classify", "add_special_tokens": req.add_special_tokens,
                   "truncate_prompt_tokens": req.truncate_prompt_tokens,
                   "truncation_side": req.truncation_side}  # fmt: skip
        calls = [handle.embed.remote(msgspec.structs.replace(p, **changes)) for p in inputs]
        results = await self._call(req.model, calls)
        data = [{"index": i, "label": r.label, "probs": r.embedding,
                 "num_classes": len(r.embedding)} for i, r in enumerate(results)]  # fmt: skip
        tokens = sum(r.prompt_tokens for r in results)
        return {**_header("classify", req.model), "data": data, "usage": _usage(tokens)}

    async def score(self, req: ScoreRequest) -> Any:
        check_extra_fields(req, _POOLING_FIELDS)
        first, second = req.sides()
        if second is None:  # the field missing of the pair the request began
            raise APIError(400, f"{first}: Field required", str(first))
        result = await self._score(req.model, first, second)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(result.scores)]
        return {**_header("score", req.model), "data": data, "usage": _usage(result.prompt_tokens)}

    async def rerank(self, req: RerankRequest) -> Any:
        check_extra_fields(req, _POOLING_FIELDS)
        documents = req.document_texts()
        if not documents:
            raise APIError(400, "documents: must hold at least one document", "documents")
        if req.top_n is not None and req.top_n < 0:
            raise APIError(400, f"top_n: must be >= 0 (0: every document), got {req.top_n}",
                           "top_n")  # fmt: skip
        result = await self._score(req.model, req.query, documents)
        order = sorted(range(len(documents)), key=lambda i: -result.scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": result.scores[i]}
            if req.return_documents:
                item["document"] = {"text": documents[i]}
            results.append(item)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": req.model, "results": results,
                "usage": {"prompt_tokens": result.prompt_tokens,
                          "total_tokens": result.prompt_tokens}}  # fmt: skip

    async def _score(self, model: str, text_1: str | list[str], text_2: str | list[str]) -> Any:
        handle = await self._server_of(model)
        await self._admit(model)
        first = [text_1] if isinstance(text_1, str) else text_1
        second = [text_2] if isinstance(text_2, str) else text_2
        request = ServerScoreRequest(text_1=first, text_2=second)
        (result,) = await self._call(model, [handle.score.remote(request)])
        return result


__all__ = ["PoolingServicer"]
