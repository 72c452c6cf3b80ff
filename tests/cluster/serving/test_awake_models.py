"""The ingress's awake set (``sleep_mode.max_awake_models``), with a scripted ``put_to_sleep``
(which models are busy): the least recently used idle model sleeps to make room, a recently
used one is spared, a busy one is skipped, and when every candidate stays busy the request
gets a 503 after the timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.api.api_errors import APIError
from cluster.serving import awake_models
from cluster.serving.awake_models import AwakeModels


class Models:
    """``put_to_sleep`` over a set of busy models; records what it put to sleep."""

    def __init__(self, busy: set[str] | None = None) -> None:
        self.busy = busy or set()
        self.slept: list[str] = []

    async def put_to_sleep(self, model: str) -> bool:
        if model in self.busy:
            return False
        self.slept.append(model)
        return True


@pytest.fixture(autouse=True)
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(awake_models, "RECENT_S", 0.0)


def test_the_first_models_up_to_the_limit_start_awake_the_rest_asleep() -> None:
    models = Models()
    awake = AwakeModels(["a", "b", "c"], 2, models.put_to_sleep, timeout_s=1)
    assert awake.awake == {"a", "b"}
    asyncio.run(awake.admit("a"))
    assert awake.awake == {"a", "b"} and models.slept == []
    asyncio.run(awake.admit("c"))  # b is the least recently used
    assert awake.awake == {"a", "c"} and models.slept == ["b"]


def test_the_least_recently_used_model_sleeps_to_make_room() -> None:
    models = Models()
    awake = AwakeModels(["a", "b", "c"], 2, models.put_to_sleep, timeout_s=1)

    async def turns() -> None:
        for model in ("a", "b", "c", "a"):
            await awake.admit(model)
            assert model in awake.awake and len(awake.awake) <= 2

    asyncio.run(turns())
    assert models.slept == ["a", "b"]


def test_a_model_used_within_the_grace_time_is_spared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(awake_models, "RECENT_S", 60.0)
    models = Models()
    awake = AwakeModels(["a", "b", "c"], 2, models.put_to_sleep, timeout_s=0.5)
    awake.awake = {"a", "b"}
    awake.last_used["a"] = time.monotonic()  # "a" just got a request; "b" did not for long
    asyncio.run(awake.admit("c"))
    assert models.slept == ["b"] and awake.awake == {"a", "c"}


def test_a_busy_model_is_skipped_for_the_next_idle_one() -> None:
    models = Models(busy={"a"})
    awake = AwakeModels(["a", "b", "c"], 2, models.put_to_sleep, timeout_s=1)
    awake.awake = {"a", "b"}
    asyncio.run(awake.admit("c"))
    assert models.slept == ["b"] and awake.awake == {"a", "c"}


def test_every_candidate_busy_until_the_timeout_is_a_503() -> None:
    models = Models(busy={"a", "b"})
    awake = AwakeModels(["a", "b", "c"], 2, models.put_to_sleep, timeout_s=0.3)
    awake.awake = {"a", "b"}
    with pytest.raises(APIError) as info:
        asyncio.run(awake.admit("c"))
    assert info.value.status == 503 and "stayed busy" in str(info.value.message)
    assert awake.awake == {"a", "b"}


def test_a_busy_model_going_idle_makes_room_for_the_waiting_request() -> None:
    models = Models(busy={"a", "b"})
    awake = AwakeModels(["a", "b", "c"], 2, models.put_to_sleep, timeout_s=5)
    awake.awake = {"a", "b"}

    async def scenario() -> None:
        waiting = asyncio.ensure_future(awake.admit("c"))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        models.busy.discard("b")  # b's last request ends
        await asyncio.wait_for(waiting, 2)

    asyncio.run(scenario())
    assert awake.awake == {"a", "c"}


def test_models_without_a_sleep_config_are_not_counted() -> None:
    models = Models()
    awake = AwakeModels(["a", "b"], 1, models.put_to_sleep, timeout_s=1)
    asyncio.run(awake.admit("other"))
    assert models.slept == [] and awake.awake == {"a"}
