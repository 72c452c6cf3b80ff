"""Fakes for the ingress's route tests (no Ray): a server handle's method that records its calls,
and an ingress with the real routing (``OpenAIIngress._route``) serving model ``m``, which takes
LoRA adapters. A test file gives the servicer it mixes in and ``m``'s handle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cluster.serving.ingress import OpenAIIngress


class Method:
    """A handle method: ``remote(*args)`` records ``args`` and answers ``answer(*args)``."""

    def __init__(self, answer: Callable[..., Any], calls: list[Any]) -> None:
        self.answer = answer
        self.calls = calls

    def remote(self, *args: Any) -> Any:
        self.calls.append(args[0] if len(args) == 1 else args)

        async def reply() -> Any:
            return self.answer(*args)

        return reply()


class RoutedIngress:
    """The real ``_route`` / ``_server`` over ``servers = {"m": handle}``; ``calls`` collects
    what the handle's ``Method``s were sent. ``make_handle(calls)`` builds the handle."""

    _route = OpenAIIngress._route
    _known_route = OpenAIIngress._known_route
    _server = OpenAIIngress._server

    def __init__(self, make_handle: Callable[[list[Any]], Any]) -> None:
        self.calls: list[Any] = []
        self.servers = {"m": make_handle(self.calls)}
        self.lora_models = {"m"}
