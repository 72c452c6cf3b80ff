"""The local Ray cluster that ``cluster serve`` starts (``deploy.connect("local")``) requires Ray's
token authentication: a call to its GCS without the token, or with a wrong one, is refused.
Run in a subprocess with its own HOME, so that neither the session's Ray nor the user's
~/.ray/auth_token is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import json, pathlib, grpc, ray
from cluster.ops.deploy import connect
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

connect("local")
try:
    gcs = ray.get_runtime_context().gcs_address
    token = (pathlib.Path.home() / ".ray" / "auth_token").read_text().strip()

    def call(metadata):
        with grpc.insecure_channel(gcs) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            try:
                request = gcs_service_pb2.GetAllNodeInfoRequest()
                stub.GetAllNodeInfo(request, metadata=metadata, timeout=20)
                return "OK"
            except grpc.RpcError as err:
                return err.code().name

    print(json.dumps({
        "without": call(()),
        "wrong": call((("authorization", "Bearer " + "0" * len(token)),)),
        "right": call((("authorization", "Bearer " + token),)),
    }))
finally:
    ray.shutdown()
"""


@pytest.mark.slow
def test_cluster_serve_starts_ray_with_token_authentication(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    calls = json.loads(result.stdout.strip().splitlines()[-1])
    assert calls == {"without": "UNAUTHENTICATED", "wrong": "UNAUTHENTICATED", "right": "OK"}
    assert (tmp_path / ".ray" / "auth_token").is_file()


def test_cluster_serve_starts_its_own_local_cluster_by_default() -> None:
    from cluster.cli import build_parser

    assert build_parser().parse_args(["serve", "configs/tiny.yaml"]).address == "local"
