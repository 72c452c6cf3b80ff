"""The ``cluster`` CLI as a user runs it, in subprocesses: config errors exit non-zero before
anything is deployed; ``ray start --head`` -> ``cluster deploy`` -> a request ->
``cluster status`` -> ``cluster shutdown``; a model the replicas cannot build fails ``deploy``
and ``serve`` at once. (``cluster serve`` against signals: ``test_cli_signals``.)

The cluster comes from ``ray start --head`` and goes with ``ray stop``, as a user's does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster.cli.streamed_completion import StreamedCompletion
from tests.cluster.conftest import free_port, load_yaml, wait_for

ROOT = Path(__file__).resolve().parents[3]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def cluster_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def tiny_config(tmp_path: Path) -> tuple[Path, int]:
    config = load_yaml("tiny.yaml")
    http_port = free_port()
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = free_port()
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, http_port


def load_yaml_file(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def complete(http_port: int) -> dict:
    body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def refuses_connections(http_port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


def test_config_error_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = load_yaml("tiny.yaml")
    config["models"][0]["engine_kwargs"]["foo"] = 1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    result = cluster_cli("deploy", str(path), "--address", "127.0.0.1:1", timeout=120)
    assert result.returncode == 2
    assert "models[0].engine_kwargs.foo: unknown engine argument" in result.stderr


@pytest.fixture
def ray_head() -> Iterator[str]:
    """``ray start --head`` and, at the end, ``ray stop`` — the user's own first and last steps.
    (``ray stop`` stops every Ray on the machine; in the suite none other runs at this point:
    the shared Serve cluster starts later, lazily.)"""
    port = free_port()
    started = subprocess.run(
        ["ray", "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
         "--disable-usage-stats"],
        env=cli_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        stopped = subprocess.run(
            ["ray", "stop"], env=cli_env(), capture_output=True, text=True, timeout=180
        )
        assert stopped.returncode == 0, stopped.stderr[-2000:]


def stop_process_group(process: subprocess.Popen[str], grace_s: float = 10) -> None:
    """SIGTERM the group (Ray's own graceful stop signal), SIGKILL whatever outlives the grace."""
    with contextlib.suppress(ProcessLookupError):  # the group may have exited already
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def test_deploy_request_status_redeploy_shutdown(ray_head: str, tmp_path: Path) -> None:
    config, http_port = tiny_config(tmp_path)
    deployed = cluster_cli("deploy", str(config), "--address", ray_head)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    assert f"ready: OpenAI API at http://127.0.0.1:{http_port}/v1" in deployed.stdout

    assert complete(http_port)["usage"]["completion_tokens"] == 4

    status = cluster_cli("status", "--address", ray_head, "--json", timeout=120)
    assert status.returncode == 0, status.stderr[-3000:]
    model = json.loads(status.stdout)["models"]["tiny-llama"]
    assert model["status"] == "HEALTHY"
    assert model["replicas"] == {"RUNNING": 1}
    assert model["stats"]["kv_total_blocks"] == 256
    assert model["stats"]["generation_tokens_total"] >= 4

    # Re-deploying updates the running application in place: same app and endpoint, Serve
    # rolls the replica over to the new engine settings.
    # A request in flight on the old replica finishes: the old replica drains (for
    # graceful_shutdown_timeout_s, 20 s by default) before Serve stops it.
    changed = yaml.safe_load(config.read_text())
    changed["models"][0]["engine_kwargs"].update(num_kv_blocks=1024, max_model_len=2048)
    changed["models"][0]["deployment_config"]["graceful_shutdown_timeout_s"] = 1
    config.write_text(yaml.safe_dump(changed))
    in_flight = StreamedCompletion(http_port, 200)
    redeployed = cluster_cli("deploy", str(config), "--address", ray_head)
    assert redeployed.returncode == 0, redeployed.stderr[-3000:]
    assert in_flight.finish_reasons(60) == ["length"]
    after = json.loads(cluster_cli("status", "--address", ray_head, "--json").stdout)
    assert after["models"]["tiny-llama"]["replicas"] == {"RUNNING": 1}
    assert after["models"]["tiny-llama"]["stats"]["kv_total_blocks"] == 1024
    assert complete(http_port)["usage"]["completion_tokens"] == 4

    # Shutting down drains too: now for 1 s, after which what is left ends with "abort"
    # (a last chunk, then [DONE]) rather than a cut connection. Streams of 2000 tokens are kept
    # eight in flight until the CLI returns, so some are running when the drain ends however
    # long the CLI takes to start; each one that started ends with a finish and [DONE].
    shutdown = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "shutdown", "--address", ray_head],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    streams: list[StreamedCompletion] = []
    deadline = time.monotonic() + 120
    while shutdown.poll() is None and time.monotonic() < deadline:
        if sum(s.thread.is_alive() for s in streams) < 8:
            streams.append(StreamedCompletion(http_port, 2000))
        else:
            time.sleep(0.1)
    _, stderr = shutdown.communicate(timeout=30)
    assert shutdown.returncode == 0, stderr[-3000:]
    # The streams that got tokens (the rest were refused once the drain began).
    endings = [s.finish_reasons(60) for s in streams if s.events]
    assert endings and all(e in (["abort"], ["length"]) for e in endings), endings
    assert ["abort"] in endings, endings  # some were still running when the drain ended
    wait_for(lambda: refuses_connections(http_port), 30, "the HTTP endpoint to go away")


def start_serving(config: Path) -> subprocess.Popen[str]:
    """``cluster serve CONFIG`` on a local Ray of its own, once it says it is serving."""
    serving = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", str(config), "--address", "local"],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    printed: list[str] = []
    for line in serving.stdout:
        printed.append(line)
        if "press Ctrl-C" in line:
            break
    else:
        serving.wait(30)
        pytest.fail(f"cluster serve exited ({serving.returncode}):\n{''.join(printed)[-3000:]}")
    return serving


def grpc_tokens(grpc_port: int) -> int:
    import grpc

    from cluster.proto import llm_pb2, llm_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        request = llm_pb2.GenerateRequest(model="tiny-llama", prompt="hello", max_tokens=4)
        replies = list(llm_pb2_grpc.LLMStub(channel).Generate(request, timeout=60))
    return replies[-1].completion_tokens


# ---- a model the engine cannot build: refused before placing, or failed at once -------------

REFUSAL = "architectures: 'FooForCausalLM' is not supported; supported: "
# The CLI on a deploying machine that cannot read the checkpoint (it is on the workers' disks
# only): its config check skips the checkpoint, which the replicas then read for real.
BLIND_CLI = ("import sys, cluster.config.deployment as c; "
             "c._checkpoint_reachable = lambda s: False; "
             "from cluster.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip


def refused_model_config(tmp_path: Path) -> tuple[Path, Path]:
    """A config serving model "q3" from a checkpoint whose config.json names an architecture
    the engine does not build (the tiny Llama's otherwise); (config, checkpoint)."""
    from engine.builtin.catalog import resolve_model_source

    checkpoint = tmp_path / "foo-checkpoint"
    shutil.copytree(resolve_model_source("builtin:tiny-llama"), checkpoint)
    hf = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**hf, "architectures": ["FooForCausalLM"]}))
    config, _ = tiny_config(tmp_path)
    data = load_yaml_file(config)
    data["models"][0]["model_loading_config"] = {"model_id": "q3", "model_source": str(checkpoint)}
    config.write_text(yaml.safe_dump(data))
    return config, checkpoint


def blind_cluster_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLIND_CLI, *args],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture
def own_ray_head() -> Iterator[str]:
    """``ray start --head --block``, stopped by ending its process group: unlike ``ray stop``,
    it leaves any other Ray on the machine running. (Its processes, given SIGTERM, take about a
    minute to exit; the test's cluster needs no graceful end, so they get SIGKILL after 5 s.)"""
    port = free_port()
    head = subprocess.Popen(
        ["ray", "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
         "--disable-usage-stats", "--block"],
        env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: not refuses_port(port), 120, "the Ray head's GCS port")
        yield f"127.0.0.1:{port}"
    finally:
        stop_process_group(head, grace_s=5)
        # What ``ray stop`` also removes: the head's address for ``address="auto"``, which
        # would otherwise name a dead cluster.
        from ray._private.utils import get_ray_address_file

        current = Path(get_ray_address_file(None))
        with contextlib.suppress(FileNotFoundError):
            if current.read_text().strip().endswith(f":{port}"):
                current.unlink()


def refuses_port(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_checkpoint_the_engine_refuses_is_refused_before_ray_starts(tmp_path: Path) -> None:
    config, checkpoint = refused_model_config(tmp_path)
    where = f"models[0].model_loading_config.model_source: {checkpoint} (config.json)"
    # Port 1 has no Ray: a deploy that got as far as connecting would hang there, not exit 2.
    for command in ("deploy", "--address", "127.0.0.1:1"), ("serve", "--address", "local"):
        result = cluster_cli(command[0], str(config), *command[1:], timeout=120)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stdout == ""  # not even "deploying ...": no Ray was started or joined
        assert result.stderr.splitlines()[-1].startswith(f"config error: {where}: {REFUSAL}")
        assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_replicas_that_cannot_build_their_model_fail_deploy_at_once_with_the_reason(
    own_ray_head: str, tmp_path: Path
) -> None:
    """The checkpoint is readable only where the replicas run: each replica's real engine
    build refuses it. ``cluster deploy`` ends at the first failure, with the reason and without
    a traceback; the app is removed, and ``cluster status`` says why until ``shutdown``."""
    config, _ = refused_model_config(tmp_path)
    deployed = blind_cluster_cli("deploy", str(config), "--address", own_ray_head)
    assert deployed.returncode == 1, deployed.stderr[-3000:]
    assert deployed.stderr.splitlines()[-1].startswith(f"error: model 'q3' cannot start: {REFUSAL}")
    assert "Traceback" not in deployed.stdout + deployed.stderr
    assert "ready:" not in deployed.stdout

    status = cluster_cli("status", "--address", own_ray_head, timeout=120)
    assert status.returncode == 1, status.stderr[-3000:]
    lines = status.stdout.splitlines()
    assert lines[:2] == ["app llm: DEPLOY_FAILED (removed: its replicas could not start)",
                         "  q3: DEPLOY_FAILED (no replicas)"]  # fmt: skip
    assert lines[2].startswith(f"    model 'q3' cannot start: {REFUSAL}")

    assert cluster_cli("shutdown", "--address", own_ray_head, timeout=120).returncode == 0
    after = cluster_cli("status", "--address", own_ray_head, "--json", timeout=120)
    assert json.loads(after.stdout) == {"app": "llm", "status": "NOT_DEPLOYED", "models": {}}


@pytest.mark.slow
def test_serve_with_a_model_its_replicas_cannot_build_exits_1_with_the_reason(
    tmp_path: Path,
) -> None:
    config, _ = refused_model_config(tmp_path)
    served = blind_cluster_cli("serve", str(config), "--address", "local")
    assert served.returncode == 1, served.stderr[-3000:]
    assert served.stderr.splitlines()[-1].startswith(f"error: model 'q3' cannot start: {REFUSAL}")
    assert "Traceback" not in served.stdout + served.stderr


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
