"""``build_dispatch`` picks the step dispatch by the workers' device, and falls back to actor
calls when a compiled graph cannot be built (no Ray started: the compile is replaced)."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import pytest

from cluster.runtime import step_dispatch
from cluster.runtime.step_dispatch import TaskDispatch, build_dispatch


def _get(refs: list[Any], what: str) -> list[Any]:
    return refs


def _fail(message: str, exc: BaseException | None) -> NoReturn:
    raise RuntimeError(message)


def _build(resource: str) -> step_dispatch.StepDispatch:
    return build_dispatch(resource, [], 2, 1.0, _get, _fail)


def test_gpu_workers_get_the_compiled_graph_and_cpu_workers_one_actor_call_each() -> None:
    assert step_dispatch.dispatch_for("GPU") == "compiled"
    assert step_dispatch.dispatch_for("CPU") == "tasks"


def test_cpu_workers_never_compile_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    def compile_graph(*args: Any) -> NoReturn:
        raise AssertionError("a compiled graph was built for CPU workers")

    monkeypatch.setattr(step_dispatch, "CompiledDispatch", compile_graph)
    assert isinstance(_build("CPU"), TaskDispatch)


def test_a_graph_that_cannot_compile_on_gpu_falls_back_to_actor_calls_naming_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def compile_graph(*args: Any) -> NoReturn:
        raise RuntimeError("no shared-memory channels")

    monkeypatch.setattr(step_dispatch, "CompiledDispatch", compile_graph)
    with caplog.at_level(logging.WARNING, logger="llm_cluster.step_dispatch"):
        dispatch = _build("GPU")
    assert isinstance(dispatch, TaskDispatch)
    assert (
        "could not compile the step graph for the GPU workers "
        "(RuntimeError: no shared-memory channels)" in caplog.text
    )
