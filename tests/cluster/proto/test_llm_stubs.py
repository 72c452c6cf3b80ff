"""The checked-in gRPC stubs import wherever the package's requirements are met: the serve
extra asks for at least the grpcio and protobuf versions the stubs were generated with (each
stub refuses to import on an older one, and the ingress imports them, HTTP routes and all)."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[3]
PROTO = ROOT / "cluster" / "proto"


def serve_minimum(package: str) -> Version | None:
    """The lowest version of ``package`` the serve extra allows (None: no lower bound)."""
    # The serve extra's list, read as text (tomllib is Python 3.11's; the package runs on 3.10).
    serve = re.search(r"^serve = \[(.*?)\]$", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert serve is not None
    for line in re.findall(r'"([^"]+)"', serve[1]):
        requirement = Requirement(line)
        if requirement.name == package:
            bounds = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
            return max(bounds, default=None)
    return None


def test_the_serve_extra_needs_the_grpcio_the_stubs_were_generated_with() -> None:
    generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'",
                          (PROTO / "llm_pb2_grpc.py").read_text())  # fmt: skip
    assert generated is not None
    minimum = serve_minimum("grpcio")
    assert minimum is not None and minimum >= Version(generated[1])


def test_the_serve_extra_needs_the_protobuf_runtime_the_stubs_were_generated_for() -> None:
    gencode = (PROTO / "llm_pb2.py").read_text()
    generated = re.search(r"# Protobuf Python Version: ([\d.]+)", gencode)
    assert generated is not None
    minimum = serve_minimum("protobuf")
    assert minimum is not None and minimum >= Version(generated[1])
