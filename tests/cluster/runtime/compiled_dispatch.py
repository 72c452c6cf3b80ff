"""Sends the Ray executor's steps through the compiled graph on CPU workers, where it picks
one actor call per worker: ``cluster.runtime.step_dispatch.dispatch_for`` replaced, in this
process (``forced``) or, through a Ray ``worker_process_setup_hook``, in every worker process
of a test's Ray, the Serve replicas' head actors included (``runtime_env``). Production code
has no setting for it: the dispatch follows the workers' device.

    with compiled_dispatch.forced("compiled"):
        executor.execute_model(request)  # the first step builds the dispatch
    ray.init(runtime_env=compiled_dispatch.runtime_env(serve.runtime_env()))
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from cluster.runtime import step_dispatch

HOOK = "tests.cluster.runtime.compiled_dispatch.force_compiled"


@contextmanager
def forced(mode: str) -> Iterator[None]:
    """Every step dispatch built meanwhile is ``mode`` (``compiled`` or ``tasks``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_dispatch, "dispatch_for", lambda resource: mode)
        yield


def force_compiled() -> None:
    step_dispatch.dispatch_for = lambda resource: "compiled"  # type: ignore[assignment]


def runtime_env(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a job runtime_env that puts this checkout on the import path) with the hook."""
    return {**base, "worker_process_setup_hook": HOOK}
