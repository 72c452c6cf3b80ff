"""The prefill hop of a disaggregated model (``disaggregation`` in the deployment YAML), run by
the ingress before it opens the request's stream on the decode pool:

    ingress ── prompt, max_tokens 1 ──> prefill pool (kv_producer: saves the prompt's blocks)
       │            (waits for its end, at most prefill_timeout_s)
       └─ the request as sent ───────> decode pool (kv_consumer: loads them, computes the rest)

The prefill request renders the same prompt (messages, tools, template variables, adapter and
cache salt are the request's), so its blocks have the hashes the decode pool looks up. The
hop never fails a request: a timeout, a refusal or a dead prefill replica only costs the
decode pool the prompt's compute (its engine recomputes what the store does not hold)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import ray
from ray.serve.exceptions import BackPressureError

from cluster.api.replica_messages import GenerateRequest, StreamError, new_request_id

logger = logging.getLogger("llm_cluster.serve")

# The prompt's own fields that a sampling parameter may change.
_PROMPT_PARAMS = ("truncate_prompt_tokens",)


def prefill_request(payload: GenerateRequest) -> GenerateRequest:
    """The prefill pool's request for ``payload``: its prompt, one greedy token, nothing else."""
    params: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0}
    params.update((k, payload.params[k]) for k in _PROMPT_PARAMS if k in payload.params)
    return msgspec.structs.replace(
        payload, params=params, request_id=new_request_id(), echo=False, channel=None,
        timeout=None,
    )  # fmt: skip


async def run_prefill(
    handle: Any, adapter: str | None, payload: GenerateRequest, timeout_s: float, model: str
) -> bool:
    """Prefill ``payload``'s prompt on ``handle`` (the prefill pool); True when it finished
    within ``timeout_s``. Failures are logged, never raised."""
    if adapter is not None:
        handle = handle.options(multiplexed_model_id=adapter)
    stream = handle.options(stream=True).generate.remote(prefill_request(payload))
    try:
        error = await asyncio.wait_for(_last_error(stream), timeout_s)
    except TimeoutError:
        logger.warning("model %s: prefill took over %.3g s; decode computes the prompt", model,
                       timeout_s)  # fmt: skip
        return False
    except (ray.exceptions.RayError, BackPressureError) as exc:
        logger.warning("model %s: prefill failed (%s); decode computes the prompt", model,
                       type(exc).__name__)  # fmt: skip
        return False
    finally:
        stream.cancel()
    if error is not None:
        logger.warning("model %s: prefill refused (%s); decode computes the prompt", model,
                       error.message)  # fmt: skip
        return False
    return True


async def _last_error(stream: Any) -> StreamError | None:
    async for item in stream:
        if isinstance(item, StreamError):
            return item
    return None


__all__ = ["prefill_request", "run_prefill"]
