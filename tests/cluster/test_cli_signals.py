"""``cluster serve`` against what its surroundings do to it: a port another process holds is
refused at once, naming the port and the holder; SIGTERM to the whole process group (systemd's
default ``KillMode=control-group``, ``kill -TERM -PGID``), which reaches Ray's own processes
too, ends every stream in flight properly and the process within seconds."""

from __future__ import annotations

import json
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

from tests.cluster.conftest import wait_for
from tests.cluster.test_cli_serving import (
    ROOT,
    cli_env,
    cluster_cli,
    own_ray_head,  # noqa: F401 (a fixture)
    refuses_connections,
    start_serving,
    stop_process_group,
    tiny_config,
)


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


class SSEStream:
    """A long streamed completion read on a thread: its data payloads, and how it ended."""

    def __init__(self, http_port: int) -> None:
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2000,
                     "ignore_eos": True, "stream": True}  # fmt: skip
        self.url = f"http://127.0.0.1:{http_port}/v1/completions"
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the stream never started"

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()

    def ending(self, timeout_s: float) -> str:
        """ "finish_reason=<reason>" or "error=<type>", asserting the stream then sent [DONE]."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, f"connection broken: {self.error!r} after {self.events[-2:]}"
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        last = json.loads(self.events[-2])
        if "error" in last:
            return f"error={last['error'].get('type')}"
        reasons = [c["finish_reason"] for c in last["choices"] if c["finish_reason"]]
        assert reasons, last
        return f"finish_reason={reasons[0]}"


def _read_on_a_thread(serving: subprocess.Popen[str]) -> list[str]:
    """The process's further output, read as it comes (a full pipe would block its writes)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(serving.stdout), daemon=True).start()
    return lines


@pytest.mark.slow
def test_sigterm_to_the_process_group_ends_streams_and_exits_in_seconds(tmp_path: Path) -> None:
    """The group's SIGTERM reaches the GCS and raylet (Ray's workers lead process groups of
    their own, and get SIGTERM from the raylet): nothing is left to drain through, so the
    streams end at once and ``cluster serve`` exits 0 within seconds, instead of waiting 60 s
    on the dead GCS."""
    config, http_port = tiny_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["models"][0]["engine_kwargs"].update(num_kv_blocks=1024, max_model_len=2048)
    config.write_text(yaml.safe_dump(data))
    serving = start_serving(config)
    output = _read_on_a_thread(serving)
    try:
        streams = [SSEStream(http_port) for _ in range(4)]
        os.killpg(serving.pid, signal.SIGTERM)
        signalled = time.monotonic()
        endings = [s.ending(30) for s in streams]
        assert serving.wait(30) == 0, "".join(output)[-3000:]
        took = time.monotonic() - signalled
        assert took < 10, (took, "".join(output)[-3000:])
        # "abort" when the replicas saw the GCS gone first; an error item when the raylet
        # stopped them first (it SIGTERMs every worker once it has left the cluster).
        assert all(e == "finish_reason=abort" or e.startswith("error=") for e in endings), endings
        assert "nothing left to drain" in "".join(output)
        assert "Failed to connect to GCS" not in "".join(output)
        # The workers end with their raylet, a few seconds after it.
        wait_for(lambda: refuses_connections(http_port), 20, "the ingress to go away")
    finally:
        stop_process_group(serving)


# SIGTERM to the main process alone (KillMode=mixed, docker stop, Kubernetes) still drains:
# tests/cluster/test_cli_serving.py::test_sigterm_drains_streams_in_flight_and_exits_0.
