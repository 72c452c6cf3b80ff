"""What a Serve replica can learn about itself from Serve (the ingress and the ``LLMServer``
fronts both drain on it)."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("llm_cluster.serve")


def serve_stop_flag() -> Callable[[], bool] | None:
    """A function telling whether Serve has started stopping this replica, or None outside a
    replica. Serve (2.x) has no public hook for that moment — only ``__del__``, which it calls
    after the in-flight requests are gone — so this reads the replica's own ``_shutting_down``
    flag, reached through the replica context. If a Ray upgrade moves it, this returns None,
    the replica logs a warning and falls back to Serve's plain drain (in-flight requests past
    the deadline are cut, the ingress reports them as 503), and the drain test of
    ``tests/cluster/test_serve_faults.py`` fails first."""
    try:
        from ray.serve.context import _get_internal_replica_context

        context = _get_internal_replica_context()
    except Exception:  # not in a replica, or Serve's layout changed
        return None
    if context is None:
        return None
    callback = getattr(context, "_handle_registration_callback", None)
    for cell in getattr(callback, "__closure__", None) or ():
        replica = cell.cell_contents
        is_replica = type(replica).__module__ == "ray.serve._private.replica"
        if is_replica and isinstance(getattr(replica, "_shutting_down", None), bool):
            return lambda: bool(replica._shutting_down)
    logger.warning("cannot observe Serve's replica shutdown: graceful drain falls back to "
                   "Serve's own (requests past graceful_shutdown_timeout_s are cut)")  # fmt: skip
    return None


__all__ = ["serve_stop_flag"]
