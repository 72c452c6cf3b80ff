"""The prefill hop of a disaggregated model (``disaggregation`` in the deployment YAML), run by
the ingress before it opens the request's stream on the decode pool:

    ingress ── prompt, max_tokens 1 ──> prefill pool (kv_producer: saves the prompt's blocks)
       │            (waits for its end, at most prefill_timeout_s)
       └─ the request as sent ───────> decode pool (kv_consumer: loads them, computes the rest)

The prefill request renders the same prompt (messages, tools, template variables, adapter and
cache salt are the request's), so its blocks have the hashes the decode pool looks up. With
``NixlConnector`` it asks for remote decode (``kv_transfer_params``, vLLM's), and the decode
request carries the ``kv_transfer_params`` the prefill's last message returned (where the
decode engine reads the blocks from). The hop never fails a request: a timeout, a refusal or
a dead prefill replica only costs the decode pool the prompt's compute (its engine recomputes
what it cannot load)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from cluster.api.replica_messages import (
    GenerateRequest,
    StreamDelta,
    StreamError,
    new_request_id,
)
from cluster.serving.ingress_calls import REPLICA_ERRORS

logger = logging.getLogger("llm_cluster.serve")

# The prompt's own fields that a sampling parameter may change.
_PROMPT_PARAMS = ("truncate_prompt_tokens",)


def prefill_request(
    payload: GenerateRequest, connector: str = "SharedStorageConnector"
) -> GenerateRequest:
    """The prefill pool's request for ``payload``: its prompt, one greedy token, nothing else
    (``NixlConnector``: and the ask to hold its blocks for a remote decode)."""
    params: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0}
    params.update((k, payload.params[k]) for k in _PROMPT_PARAMS if k in payload.params)
    if connector == "NixlConnector":
        params["extra_args"] = {"kv_transfer_params": {"do_remote_decode": True}}
    return msgspec.structs.replace(
        payload, params=params, request_id=new_request_id(), echo=False, channel=None,
        timeout=None,
    )  # fmt: skip


def decode_request(
    payload: GenerateRequest, kv_transfer_params: dict[str, Any] | None
) -> GenerateRequest:
    """``payload`` for the decode pool: as sent, with the prefill's ``kv_transfer_params``
    (``extra_args``, vLLM's place) when it returned some."""
    if not kv_transfer_params:
        return payload
    extra = {**(payload.params.get("extra_args") or {}), "kv_transfer_params": kv_transfer_params}
    return msgspec.structs.replace(payload, params={**payload.params, "extra_args": extra})


async def run_prefill(
    handle: Any,
    adapter: str | None,
    payload: GenerateRequest,
    timeout_s: float,
    model: str,
    connector: str = "SharedStorageConnector",
) -> GenerateRequest:
    """Prefill ``payload``'s prompt on ``handle`` (the prefill pool), for at most
    ``timeout_s``; returns the decode pool's request (``decode_request``). Failures are
    logged, never raised: the request goes on as sent."""
    params = await prefill(handle, adapter, payload, timeout_s, model, connector)
    return decode_request(payload, params)


async def prefill(
    handle: Any,
    adapter: str | None,
    payload: GenerateRequest,
    timeout_s: float,
    model: str,
    connector: str = "SharedStorageConnector",
) -> dict[str, Any] | None:
    """The prefill hop: None when it did not finish within ``timeout_s`` (or failed), else
    the ``kv_transfer_params`` its last message carried (``{}``: none)."""
    if adapter is not None:
        handle = handle.options(multiplexed_model_id=adapter)
    stream = handle.options(stream=True).generate.remote(prefill_request(payload, connector))
    try:
        error, params = await asyncio.wait_for(_last_item(stream), timeout_s)
    except TimeoutError:
        logger.warning("model %s: prefill took over %.3g s; decode computes the prompt", model,
                       timeout_s)  # fmt: skip
        return None
    except REPLICA_ERRORS as exc:
        logger.warning("model %s: prefill failed (%s); decode computes the prompt", model,
                       type(exc).__name__)  # fmt: skip
        return None
    finally:
        stream.cancel()
    if error is not None:
        logger.warning("model %s: prefill refused (%s); decode computes the prompt", model,
                       error.message)  # fmt: skip
        return None
    return params


async def _last_item(stream: Any) -> tuple[StreamError | None, dict[str, Any]]:
    """The stream's error, or the kv_transfer_params of its last delta."""
    params: dict[str, Any] = {}
    async for item in stream:
        if isinstance(item, StreamError):
            return item, params
        if isinstance(item, StreamDelta) and item.kv_transfer_params:
            params = item.kv_transfer_params
    return None, params


__all__ = ["decode_request", "prefill", "prefill_request", "run_prefill"]
