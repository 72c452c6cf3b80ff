"""The sleep-mode admin routes on the ingress, mixed into ``OpenAIIngress`` (vLLM's paths):
``POST /sleep?model=M&level=1``, ``POST /wake_up?model=M[&tags=weights]``, ``GET /is_sleeping
?model=M``. Each reaches every replica of the model at once (Serve's ``broadcast``) and
answers with the model's state; ``model`` may be left out when the app serves one model.

``/sleep`` and ``/wake_up`` change what a deployment serves, so they are admin routes: only
with ``api_keys`` in the deployment config (a key is then required, as on every route), else
403. A replica with requests in flight refuses to sleep (409); the others sleep anyway, and a
request wakes whichever it reaches (``cluster.serving.sleep_server``). With
``sleep_mode.max_awake_models``, every request is first admitted by the awake set
(``cluster.serving.awake_models``), which may put another model to sleep."""

from __future__ import annotations

from typing import Any

import ray
from fastapi.responses import JSONResponse

from cluster.api.api_errors import APIError
from cluster.serving.awake_models import AwakeModels


class SleepServicer:
    """The admin routes over ``servers`` and ``_server`` (``OpenAIIngress``'s)."""

    servers: dict[str, Any]
    api_key_hashes: list[str]
    awake: AwakeModels | None
    _server: Any

    def _init_awake(self, spec: tuple[dict[str, int], int, float] | None) -> None:
        """``spec``: (sleep level of each model with a sleep_config, max awake, timeout)."""
        self.awake = None
        if spec is not None:
            levels, limit, timeout_s = spec

            async def put_to_sleep(model: str) -> bool:
                try:
                    reply = await self._broadcast(model, "sleep", levels[model])
                except APIError:  # busy (409) or gone: not this one
                    return False
                return bool(reply["is_sleeping"])

            self.awake = AwakeModels(list(levels), limit, put_to_sleep, timeout_s)

    async def _admit(self, model: str) -> None:
        """Before a request to ``model`` (a base model's name) is sent."""
        if self.awake is not None:
            await self.awake.admit(model)

    # ---- the routes ------------------------------------------------------------------------

    async def sleep(self, model: str | None, level: int) -> Any:
        self._check_admin("/sleep")
        return JSONResponse(await self.sleep_model(model, level))

    async def wake_up(self, model: str | None, tags: list[str] | None) -> Any:
        self._check_admin("/wake_up")
        return JSONResponse(await self.wake_model(model, tags))

    async def sleep_state(self, model: str | None) -> Any:
        return JSONResponse(await self.model_sleep_state(model))

    # ---- handle methods (the routes, ``cluster sleep`` / ``wake``): APIError on refusal ----

    async def sleep_model(self, model: str | None, level: int = 1) -> dict[str, Any]:
        model = self._model(model)
        reply = await self._broadcast(model, "sleep", level)
        if self.awake is not None and reply["is_sleeping"]:
            self.awake.awake.discard(model)
        return reply

    async def wake_model(self, model: str | None, tags: list[str] | None = None) -> dict[str, Any]:
        model = self._model(model)
        await self._admit(model)
        return await self._broadcast(model, "wakeup", tags)

    async def model_sleep_state(self, model: str | None) -> dict[str, Any]:
        return await self._broadcast(self._model(model), "sleep_state")

    def _check_admin(self, route: str) -> None:
        if not self.api_key_hashes:
            raise APIError(403, f"{route} is an admin route: it needs api_keys in the deployment "
                                "config", None, "admin_routes_disabled")  # fmt: skip

    def _model(self, model: str | None) -> str:
        if model is not None:
            self._server(model)  # the 404
            return model
        if len(self.servers) != 1:
            raise APIError(400, f"name one of the {len(self.servers)} models served: "
                                f"{sorted(self.servers)}", "model")  # fmt: skip
        return next(iter(self.servers))

    async def _broadcast(self, model: str, method: str, *args: Any) -> dict[str, Any]:
        """``method`` on every replica of ``model``: the first refusal's status and message,
        else the model's state (asleep when every replica is)."""
        try:
            replies = await self._server(model).broadcast(method, *args).results_async()
        except ray.exceptions.RayError as exc:
            raise APIError(503, f"model {model!r} is not available", None,
                           "unavailable") from exc  # fmt: skip
        refused = [r for r in replies if "error" in r]
        if refused:
            raise APIError(refused[0]["status"], refused[0]["error"], None, "sleep_refused")
        levels = [r["sleep_level"] for r in replies]
        asleep = bool(levels) and all(level is not None for level in levels)
        return {"model": model, "is_sleeping": asleep, "replicas": len(replies),
                "sleep_level": max(levels) if asleep else None}  # fmt: skip
