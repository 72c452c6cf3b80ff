"""The ingress's hooks into Ray Serve's replica process (``cluster.serving.serve_replica``):
its direct-ingress port is bound so that a server started right after it binds the same port,
although the connections it closed first linger in TIME-WAIT there."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from cluster.serving.serve_replica import reuse_address_on_direct_ingress
from tests.cluster.conftest import free_port


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _serve_then_stop(port: int) -> tuple[int, int]:
    """Start Serve's direct-ingress HTTP server on ``port`` as a replica does, answer a
    keep-alive client, and stop while the client still holds its connection (so this server
    closes it first: TIME-WAIT on ``port``). Returns the listening socket's SO_REUSEADDR and
    SO_REUSEPORT."""
    from ray.serve._private import replica
    from ray.serve.config import HTTPOptions

    loop = asyncio.get_running_loop()
    options = HTTPOptions(host="127.0.0.1", port=port)
    task, server = await replica.start_asgi_http_server(
        _app, options, event_loop=loop, enable_so_reuseport=False
    )
    while not server.started:
        await asyncio.sleep(0.01)
    listening = server.servers[0].sockets[0]
    options_set = (
        listening.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR),
        listening.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT),
    )
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
        server.should_exit = True
        await task
    return options_set


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private import http_util, replica

    monkeypatch.setattr(replica, "start_asgi_http_server", replica.start_asgi_http_server)
    monkeypatch.setattr(http_util, "set_socket_reuse_port", http_util.set_socket_reuse_port)
    assert reuse_address_on_direct_ingress()


def test_direct_ingress_port_can_be_bound_again_at_once_after_a_stop(hooked: None) -> None:
    port = free_port()
    assert asyncio.run(_serve_then_stop(port)) == (1, 0)  # SO_REUSEADDR; never SO_REUSEPORT
    # The next server on the port: a restarted ingress, or a new ``cluster serve``.
    assert asyncio.run(_serve_then_stop(port)) == (1, 0)


def test_the_hook_is_installed_once(hooked: None) -> None:
    from ray.serve._private import replica

    start = replica.start_asgi_http_server
    assert reuse_address_on_direct_ingress()
    assert replica.start_asgi_http_server is start
