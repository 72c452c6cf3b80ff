"""Is a port the config names free to serve on, and if not, who holds it (or why its host
cannot be listened on here: a name this machine does not resolve, an address not its own)?

``cluster serve`` asks before it starts Ray: a port in use would otherwise surface 20 s later as
Serve's "Failed to update the deployments ['OpenAIIngress']" without a word of the port.
``cluster deploy`` asks each node of the cluster before Serve first starts there (a running
Serve keeps the ports it has)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.config import DeploymentConfig

# The state column of /proc/net/tcp{,6}: listening; a connection closed here, not yet gone
# (FIN-WAIT-1/2, TIME-WAIT, CLOSING, LAST-ACK).
_TCP_LISTEN = "0A"
_TCP_CLOSING = ("04", "05", "06", "0B", "09")


class PortInUseError(RuntimeError):
    """A port of the config cannot be bound; the message names the field, port, host and (when
    this machine can tell) the process holding it."""


def config_ports(config: DeploymentConfig) -> list[tuple[str, str, int]]:
    """``(field, host, port)`` for each port the config serves on."""
    host = config.http_options.host
    ports = [("http_options.port", host, config.http_options.port)]
    if config.grpc_options is not None:
        # Serve's gRPC proxy (and the direct-ingress gRPC server) listen on every interface.
        ports.append(("grpc_options.port", "0.0.0.0", config.grpc_options.port))
    return ports


def check_ports_free(ports: list[tuple[str, str, int]], where: str = "") -> None:
    """Raise ``PortInUseError`` for the first port that this machine cannot bind: in use (by
    whom, when this machine can tell), or its host not one to listen on here."""
    for field, host, port in ports:
        error = bind_error(host, port)
        if error is None:
            continue
        if error.errno != errno.EADDRINUSE:
            raise PortInUseError(_cannot_bind(field, host, port, error, where))
        holder = port_holder(port)
        if holder is None and _lingering(port):
            raise PortInUseError(
                f"{field} {port} on {host}{where} is held by connections of a server that "
                "stopped without SO_REUSEADDR, in TIME-WAIT: they clear within 60 s; wait, "
                "or choose another port"
            )
        by = f" by {holder}" if holder else " by another process"
        raise PortInUseError(
            f"{field} {port} on {host}{where} is in use{by}: stop it, or choose another port"
        )


def _cannot_bind(field: str, host: str, port: int, error: OSError, where: str) -> str:
    """Why ``host:port`` cannot be bound, other than a server on it, naming the field at fault:
    the host's (a name that does not resolve, an address not of this machine), else the
    port's (one below 1024 without the privilege, ...)."""
    why = ""
    if isinstance(error, socket.gaierror):
        field, why = field.rsplit(".", 1)[0] + ".host", " (not a host name this machine resolves)"
    elif error.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):
        field, why = field.rsplit(".", 1)[0] + ".host", " (not an address of this machine)"
    address = f"[{host}]:{port}" if _is_ipv6(host) else f"{host}:{port}"
    return f"{field}: cannot bind {address}{where}: {error.strerror or error}{why}"


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def can_bind(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (``bind_error``)."""
    return bind_error(host, port) is None


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host:port`` now, or None. SO_REUSEADDR as every
    server here sets it (uvicorn, gRPC, Serve's proxies, the direct ingress:
    ``serve_replica.reuse_address_on_direct_ingress``), so a port whose old connections linger
    in TIME-WAIT counts as free, as it is for them (Linux lets both bind when the lingering
    connections' listener set it too)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:  # socket.gaierror too: a name that does not resolve
            return exc
    return None


def port_holder(port: int) -> str | None:
    """ "<name> (pid N)" of the process listening on TCP ``port``, read from /proc (Linux);
    "a process of another user" when the socket is visible but its process is not; None when
    this machine cannot tell."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return f"{_process_name(pid_dir)} (pid {pid_dir.name})"
    return "a process of another user"


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port``, from /proc/net/tcp and tcp6."""
    return {inode for state, inode in _sockets_on(port) if state == _TCP_LISTEN}


def _lingering(port: int) -> bool:
    """Whether closed connections (TIME-WAIT, FIN-WAIT) still hold local ``port``."""
    return any(state in _TCP_CLOSING for state, _ in _sockets_on(port))


def _sockets_on(port: int) -> list[tuple[str, str]]:
    """(state, inode) of every TCP socket whose local port is ``port`` (/proc/net/tcp{,6})."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if int(local.rsplit(":", 1)[1], 16) == port:
                found.append((state, inode))
    return found


def _process_name(pid_dir: Path) -> str:
    try:
        cmdline = (pid_dir / "cmdline").read_bytes().split(b"\0")
        name = (pid_dir / "comm").read_text().strip()
    except OSError:
        return "a process"
    args = [a.decode(errors="replace") for a in cmdline if a]
    return f"{name}: {' '.join(args)[:120]}" if args else name


def check_cluster_ports(config: DeploymentConfig, timeout_s: float = 60.0) -> None:
    """Before Serve first starts on a running cluster: raise ``PortInUseError`` when a port of
    the config is taken on one of its nodes (Serve runs a proxy on every node). Nothing to
    check once Serve runs: its proxies keep the ports they hold."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")  # Serve's own names
        return
    except ValueError:  # Serve not running
        pass
    probe = ray.remote(num_cpus=0)(_probe_node)
    probes = [
        probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(config_ports(config), node["NodeManagerAddress"])
        for node in ray.nodes()
        if node["Alive"]
    ]
    for message in ray.get(probes, timeout=timeout_s):
        if message is not None:
            raise PortInUseError(message)


def _probe_node(ports: list[tuple[str, str, int]], node_ip: str) -> str | None:
    try:
        check_ports_free(ports, where=f" (node {node_ip})")
    except PortInUseError as exc:
        return str(exc)
    return None


__all__ = [
    "PortInUseError",
    "bind_error",
    "can_bind",
    "check_cluster_ports",
    "check_ports_free",
    "config_ports",
    "port_holder",
]
