"""The port check before ``cluster serve`` starts Ray (``cluster.ops.ports``), on real sockets:
connections a stopped server closed first, in TIME-WAIT, do not count as a server on the port
when that server bound it as every server here does (SO_REUSEADDR); where one did not, the
refusal says what holds the port and that it clears by itself. A host this machine cannot
listen on is named as the fault, never reported as a port in use."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from cluster.ops.ports import PortInUseError, check_ports_free
from tests.cluster.conftest import free_port


def _stopped_server_leaves_time_wait(port: int, reuse_address: bool) -> None:
    """A server on ``port`` that answers one client and closes its connection first, then
    stops: the connection sits in TIME-WAIT on ``port``."""
    with socket.socket() as server:
        if reuse_address:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server's side closes first
            assert client.recv(1) == b""
    assert _time_wait(port)


def _time_wait(port: int) -> list[list[str]]:
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return [f for f in (line.split() for line in lines)
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "06"]  # fmt: skip


def test_time_wait_of_a_server_with_so_reuseaddr_leaves_the_port_free() -> None:
    port = free_port()
    _stopped_server_leaves_time_wait(port, reuse_address=True)
    check_ports_free([("http_options.port", "127.0.0.1", port)])


def test_time_wait_of_a_server_without_it_is_refused_saying_it_clears_by_itself() -> None:
    port = free_port()
    _stopped_server_leaves_time_wait(port, reuse_address=False)
    with pytest.raises(PortInUseError) as refused:
        check_ports_free([("http_options.port", "127.0.0.1", port)])
    assert str(refused.value).startswith(
        f"http_options.port {port} on 127.0.0.1 is held by connections of a server that stopped "
        "without SO_REUSEADDR, in TIME-WAIT: they clear within 60 s"
    )


def test_a_port_a_server_listens_on_is_in_use_naming_the_server() -> None:
    port = free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        with pytest.raises(PortInUseError) as refused:
            check_ports_free([("http_options.port", "127.0.0.1", port)])
    assert str(refused.value).startswith(f"http_options.port {port} on 127.0.0.1 is in use by ")
    assert f"(pid {os.getpid()})" in str(refused.value)


def test_a_host_with_a_port_in_it_names_the_host_not_a_port_in_use() -> None:
    port = free_port()
    with pytest.raises(PortInUseError) as refused:
        check_ports_free([("http_options.port", "localhost:8000", port)])
    message = str(refused.value)
    assert message.startswith(f"http_options.host: cannot bind localhost:8000:{port}: ")
    assert message.endswith("(not a host name this machine resolves)")
    assert "in use" not in message


def test_an_address_not_of_this_machine_names_the_host_not_a_port_in_use() -> None:
    port = free_port()
    host = "192.0.2.1"  # TEST-NET-1 (RFC 5737): no machine's address
    with pytest.raises(PortInUseError) as refused:
        check_ports_free([("http_options.port", host, port)], where=" (node 10.0.0.2)")
    assert str(refused.value) == (
        f"http_options.host: cannot bind {host}:{port} (node 10.0.0.2): "
        f"{os.strerror(errno.EADDRNOTAVAIL)} (not an address of this machine)"
    )


def test_cluster_serve_leaves_a_host_with_a_port_to_the_config_error(tmp_path: Path) -> None:
    """The port check before loading does not bind a host that the config check refuses:
    ``cluster serve`` then exits 2 naming ``http_options.host``, not 1 on a bind error."""
    from cluster.cli import _refuse_busy_ports_before_loading
    from cluster.config import load_config
    from engine.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text(
        "models:\n  - model_loading_config: {model_id: m, model_source: builtin:tiny-llama}\n"
        "    engine_kwargs: {device: cpu}\n"
        f"http_options: {{host: 'localhost:{free_port()}', port: {free_port()}}}\n"
    )
    _refuse_busy_ports_before_loading(str(config))  # no SystemExit(1)
    with pytest.raises(ConfigError, match=r"^http_options\.host: "):
        load_config(config)
