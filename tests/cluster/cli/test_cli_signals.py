"""``cluster serve`` against what its surroundings do to it, as a user (systemd, a terminal,
Kubernetes) does it: a port another process holds is refused at once, naming the port and the
holder; SIGTERM to the whole process group (``kill -TERM -PGID``) drains every stream to its
ending; Ctrl-C stops it and a restart right after binds the same ports; a stop while it
still deploys removes what started and says so in one line; the ingress stopped by SIGTERM ends
its streams before it exits and comes back on its port; and a signal that reaches Ray's own
processes too (a whole cgroup) still ends ``cluster serve`` within seconds; a hang-up stops it
like Ctrl-C, though its terminal is gone, unless it started under ``nohup``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.ops.ports import can_bind
from tests.cluster.cli.streamed_completion import StreamedCompletion
from tests.cluster.cli.test_cli_serving import (
    ROOT,
    cli_env,
    cluster_cli,
    complete,
    grpc_tokens,
    own_ray_head,  # noqa: F401 (a fixture)
    refuses_connections,
    start_serving,
    stop_process_group,
    tiny_config,
)
from tests.cluster.conftest import wait_for


def _serve(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", str(config), "--address", "local"],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def test_serve_refuses_a_port_in_use_at_once_naming_port_and_holder(tmp_path: Path) -> None:
    config, http_port = tiny_config(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", http_port))
        holder.listen()
        started = time.monotonic()
        serving = _serve(config)
        try:
            output, _ = serving.communicate(timeout=30)
        finally:
            stop_process_group(serving)
        took = time.monotonic() - started
    assert serving.returncode == 1, output[-3000:]
    assert took < 10, (took, output[-3000:])
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: http_options.port {http_port} on 127.0.0.1 is in use"), last
    assert f"(pid {os.getpid()}" in last, last  # this test's process holds it
    assert "Traceback" not in output
    assert "deploying" not in output  # refused before Ray started


@pytest.mark.slow
def test_deploy_refuses_a_port_in_use_on_a_node_before_serve_starts(
    own_ray_head: str,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    config, http_port = tiny_config(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", http_port))
        holder.listen()
        deployed = cluster_cli("deploy", str(config), "--address", own_ray_head, timeout=120)
    assert deployed.returncode == 1, deployed.stderr[-3000:]
    last = deployed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: http_options.port {http_port} on 127.0.0.1 (node "), last
    assert "is in use by python" in last and f"(pid {os.getpid()})" in last, last
    assert "deploying" not in deployed.stdout


def _read_on_a_thread(serving: subprocess.Popen[str]) -> list[str]:
    """The process's further output, read as it comes (a full pipe would block its writes)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(serving.stdout), daemon=True).start()
    return lines


def _drain_config(tmp_path: Path) -> tuple[Path, int]:
    """The tiny config with room for ``StreamedCompletion``'s long streams and a 1 s drain (the rest
    then aborts)."""
    config, http_port = tiny_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["models"][0]["engine_kwargs"].update(num_kv_blocks=1024, max_model_len=2048)
    data["models"][0]["deployment_config"]["graceful_shutdown_timeout_s"] = 1
    config.write_text(yaml.safe_dump(data))
    return config, http_port


def _processes() -> list[tuple[int, int, int, str]]:
    """(pid, process group, parent pid, command line) of every process on this machine."""
    table = subprocess.run(["ps", "-ww", "-eo", "pid=,pgid=,ppid=,args="], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    rows = [line.split(None, 3) for line in table.splitlines()]
    return [(int(pid), int(pgid), int(ppid), args) for pid, pgid, ppid, args in rows]


def _ray_processes(serve_pid: int) -> dict[str, tuple[int, int]]:
    """The GCS and raylet that the ``cluster serve`` of pid ``serve_pid`` started: name ->
    (pid, process group)."""
    found = {}
    for pid, pgid, ppid, args in _processes():
        name = Path(args.split()[0]).name
        if ppid == serve_pid and name in ("gcs_server", "raylet"):
            found[name] = (pid, pgid)
    return found


def _alive(pids: list[int]) -> list[int]:
    running = {pid for pid, *_ in _processes()}
    return [pid for pid in pids if pid in running]


def _ingress_pid(serve_pid: int) -> int:
    """The pid of the ingress replica's worker process, a child of that serve's raylet."""
    raylet_pid = _ray_processes(serve_pid)["raylet"][0]
    found = [pid for pid, _, ppid, args in _processes()
             if ppid == raylet_pid and "ServeReplica:llm:OpenAIIngress" in args]  # fmt: skip
    assert len(found) == 1, found
    return found[0]


def _ports(config: Path) -> list[int]:
    data = yaml.safe_load(config.read_text())
    return [data["http_options"]["port"], data["grpc_options"]["port"]]


@pytest.mark.slow
def test_sigterm_to_the_process_group_drains_every_stream_to_its_ending(tmp_path: Path) -> None:
    """What Ctrl-C in a terminal and ``kill -TERM -PGID`` do. Ray's processes lead process
    groups of their own, so the signal reaches ``cluster serve`` alone: a raylet that got it
    would stop every worker within ~50 ms, the ingress with its streams half written. Every
    stream ends with a finish (the drain: 1 s, then "abort") and [DONE]; ``cluster serve``
    exits 0 having let its ports go."""
    config, http_port = _drain_config(tmp_path)
    serving = start_serving(config)
    output = _read_on_a_thread(serving)
    try:
        ray_processes = _ray_processes(serving.pid)
        assert set(ray_processes) == {"gcs_server", "raylet"}, ray_processes
        assert serving.pid not in [pgid for _, pgid in ray_processes.values()], ray_processes
        streams = [StreamedCompletion(http_port, 2000, timeout_s=60) for _ in range(4)]
        os.killpg(serving.pid, signal.SIGTERM)
        signalled = time.monotonic()
        endings = [s.ending(60) for s in streams]
        assert all(e in ("finish_reason=abort", "finish_reason=length") for e in endings), endings
        assert serving.wait(60) == 0, "".join(output)[-3000:]
        assert time.monotonic() - signalled < 45, "".join(output)[-3000:]
        held = [port for port in _ports(config) if not can_bind("127.0.0.1", port)]
        assert held == [], "".join(output)[-3000:]  # free the moment it returned
        printed = "".join(output)
        assert "nothing left to drain" not in printed  # the drain ran
        for noise in ("Traceback", "failed", "Error"):  # a clean stop reads clean
            assert noise not in printed, printed[-3000:]
    finally:
        stop_process_group(serving)


@pytest.mark.slow
def test_ctrl_c_stops_serve_and_it_starts_again_on_the_same_ports_at_once(tmp_path: Path) -> None:
    """``cluster serve`` serves both of the config's ports (HTTP and gRPC, from the ingress
    replica itself) until Ctrl-C, then exits 0 and lets them go. systemd's ``Restart=``, or a
    user's Ctrl-C then the same command: the stopped server closed its clients' keep-alive
    connections first, which then sit in TIME-WAIT on its port; a new ``cluster serve`` at once
    binds it anyway (SO_REUSEADDR, as every server here binds) and serves within its normal
    start time."""
    config, http_port = tiny_config(tmp_path)
    first = start_serving(config)
    second = None
    # The client keeps its connections open, as SDKs do, until after the restart.
    with httpx.Client(timeout=60) as client:
        try:
            for _ in range(3):
                body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "stream": True}
                with client.stream("POST", f"http://127.0.0.1:{http_port}/v1/completions",
                                   json=body) as response:  # fmt: skip
                    assert response.status_code == 200
                    assert "data: [DONE]" in list(response.iter_lines())
            assert grpc_tokens(_ports(config)[1]) == 4
            os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: a terminal signals the group
            assert first.wait(120) == 0
            assert refuses_connections(http_port)
            second = _serve(config)
            printed = []
            for line in second.stdout:
                printed.append(line)
                if "press Ctrl-C" in line:
                    break
            assert second.poll() is None, "".join(printed)[-3000:]
            assert complete(http_port)["usage"]["completion_tokens"] == 4
        finally:
            stop_process_group(first)
            if second is not None:
                stop_process_group(second)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_a_stop_while_deploying_removes_what_started_and_says_so(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    """Ctrl-C (or SIGTERM) to the group while the model still loads: no traceback, no Ray stack
    dump; the app is removed, the local Ray stopped, one line says so, exit 130 (or 0)."""
    config, http_port = tiny_config(tmp_path)
    serving = _serve(config)
    try:
        printed = []
        for line in serving.stdout:
            printed.append(line)
            if "LLMServer:tiny-llama: UPDATING (1 starting)" in line:
                break
        ray_pids = [pid for pid, _ in _ray_processes(serving.pid).values()]
        assert len(ray_pids) == 2, ray_pids
        os.killpg(serving.pid, sig)
        rest, _ = serving.communicate(timeout=60)
        output = "".join(printed) + rest
        assert serving.returncode == code, output[-3000:]
        assert rest.strip().splitlines()[-1] == (
            f"stopped by {sig.name} while starting: removed application 'llm' (tiny-llama); "
            "stopped the local Ray"
        ), output[-3000:]
        assert "Traceback" not in output and "SIGTERM received" not in output, output[-3000:]
        assert "ready:" not in output
        assert _alive(ray_pids) == []  # the local Ray is stopped
        assert refuses_connections(http_port)
    finally:
        stop_process_group(serving)


@pytest.mark.slow
def test_the_ingress_stopped_by_sigterm_ends_its_streams_and_returns_on_its_port(
    tmp_path: Path,
) -> None:
    """A Ray worker gets SIGTERM when its raylet stops (then exits with it within
    milliseconds) or when someone signals it: the ingress ends every open stream with an error
    chunk and [DONE] before it exits, at once. Serve starts a new one, which binds the same
    port despite the old one's connections in TIME-WAIT."""
    config, http_port = _drain_config(tmp_path)
    serving = start_serving(config)
    output = _read_on_a_thread(serving)
    try:
        streams = [StreamedCompletion(http_port, 2000, timeout_s=60) for _ in range(3)]
        os.kill(_ingress_pid(serving.pid), signal.SIGTERM)
        signalled = time.monotonic()
        assert [s.ending(30) for s in streams] == ["error=ServiceUnavailableError"] * 3
        assert time.monotonic() - signalled < 5

        def serves_again() -> bool:
            try:
                return complete(http_port)["usage"]["completion_tokens"] == 4
            except OSError:
                return False

        wait_for(serves_again, 90, "a new ingress serving the same port", poll_s=1)
        assert serving.poll() is None, "".join(output)[-3000:]
    finally:
        stop_process_group(serving)


@pytest.mark.slow
def test_a_signal_that_reaches_rays_processes_too_still_ends_serve_in_seconds(
    tmp_path: Path,
) -> None:
    """A cgroup kill (systemd's default ``KillMode=control-group``) signals Ray's GCS and
    raylet too: nothing is left to drain through, and a drain would wait 60 s on the dead GCS.
    ``cluster serve`` notices, exits 0 within seconds, and its streams end (with "abort" when
    the replicas see the GCS gone before the raylet stops them; docs/deploy.md says to signal
    the main process alone, which drains)."""
    config, http_port = _drain_config(tmp_path)
    serving = start_serving(config)
    output = _read_on_a_thread(serving)
    try:
        streams = [StreamedCompletion(http_port, 2000, timeout_s=60) for _ in range(2)]
        ray_pids = [pid for pid, _ in _ray_processes(serving.pid).values()]
        assert len(ray_pids) == 2, ray_pids
        for pid in [serving.pid, *ray_pids]:  # each process of the cgroup, as systemd does
            os.kill(pid, signal.SIGTERM)
        signalled = time.monotonic()
        for stream in streams:
            stream.thread.join(30)
            assert not stream.thread.is_alive(), "the stream did not end"
        try:
            code = serving.wait(30)
        except subprocess.TimeoutExpired:
            code = None  # still running: what it printed says where it stopped
        assert code == 0, "".join(output)[-3000:]
        assert time.monotonic() - signalled < 15, "".join(output)[-3000:]
        assert "nothing left to drain" in "".join(output)
        assert "Failed to connect to GCS" not in "".join(output)
        wait_for(lambda: refuses_connections(http_port), 20, "the ingress to go away")
    finally:
        stop_process_group(serving)


# SIGTERM to the main process alone (KillMode=mixed, docker stop, Kubernetes) is the process
# group case above: Ray's processes lead groups of their own (asserted there), so the group's
# signal reaches ``cluster serve`` alone, as a signal to its pid does.


# SIGHUP at its default, as a terminal starts a command (this suite may run under nohup).
_STOPPED_WHILE_LOADING = """
import os, signal, sys, time
import cluster.cli as cli
signal.signal(signal.SIGHUP, signal.SIG_DFL)

def slow_load(path):  # the signal arrives while the config (and its checkpoint) is read
    os.kill(os.getpid(), {signum})
    time.sleep(5)
    raise AssertionError("the signal did not stop the load")

cli._load_config = slow_load
sys.exit(cli.main([{command!r}, "configs/tiny.yaml"]))
"""


@pytest.mark.parametrize("command", ["deploy", "serve"])
@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0), (signal.SIGHUP, 129)]
)
def test_a_stop_while_the_config_is_read_exits_with_its_code_and_no_traceback(
    command: str, signum: int, code: int
) -> None:
    """Reading the config reads the checkpoint's (seconds, more for a remote model): a stop
    then is a stop like any other (it was a traceback and exit 1 for ``cluster deploy``)."""
    script = _STOPPED_WHILE_LOADING.format(signum=int(signum), command=command)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=cli_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "nothing" in result.stdout, result.stdout  # "nothing was deployed" / "... started"


_HUNG_UP_WHILE_LOADING = """
import os, signal, sys, time
import cluster.cli as cli
{prelude}

def slow_load(path):  # a hang-up while the config is read, then a SIGTERM
    while not os.path.exists({ready!r}):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGHUP)
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    raise AssertionError("no signal stopped the load")

cli._load_config = slow_load
sys.exit(cli.main(["serve", "configs/tiny.yaml"]))
"""


def test_a_hang_up_while_the_config_is_read_stops_serve_though_its_terminal_is_gone(
    tmp_path: Path,
) -> None:
    """``cluster serve`` on a terminal that closed (a pseudo-terminal whose master is gone:
    every write to it fails with EIO) and a SIGHUP: it stops as for Ctrl-C, exit 129, its
    one line lost with the terminal and no traceback. SIGHUP used to kill it without a stop."""
    import pty

    ready = tmp_path / "terminal-closed"
    prelude = "signal.signal(signal.SIGHUP, signal.SIG_DFL)"  # (the suite may run under nohup)
    script = _HUNG_UP_WHILE_LOADING.format(prelude=prelude, ready=str(ready))
    master, terminal = pty.openpty()
    try:
        child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=cli_env(),
                                 stdin=terminal, stdout=terminal, stderr=subprocess.PIPE,
                                 text=True)  # fmt: skip
    finally:
        os.close(terminal)
        os.close(master)
    ready.touch()
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 129, stderr
    assert "Traceback" not in stderr, stderr


def test_a_hang_up_is_ignored_by_serve_started_under_nohup(tmp_path: Path) -> None:
    """Started with SIGHUP ignored (``nohup``), ``cluster serve`` keeps ignoring it: the
    SIGTERM after it is what stops it (exit 0)."""
    ready = tmp_path / "ready"
    ready.touch()
    prelude = "signal.signal(signal.SIGHUP, signal.SIG_IGN)"
    script = _HUNG_UP_WHILE_LOADING.format(prelude=prelude, ready=str(ready))
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=cli_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "stopped by SIGTERM while starting" in result.stdout, result.stdout
