"""No project module deserializes with anything that can run code: no pickle / cloudpickle / dill
/ marshal / shelve loads, no ``torch.load`` without ``weights_only=True``, no ``yaml.load``
without a safe loader, no ``numpy.load(allow_pickle=True)``. Bytes from sockets (head <->
worker, HTTP, gRPC) are decoded with msgspec, JSON or protobuf only. The scan reads the syntax
tree, so comments and docstrings that mention pickle do not count."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("llm_kernels", "parallel", "engine", "cluster", "benchmarks", "scripts")

# module -> names that turn bytes into arbitrary objects.
_UNSAFE = {
    "pickle": {"load", "loads", "Unpickler"},
    "_pickle": {"load", "loads", "Unpickler"},
    "cPickle": {"load", "loads", "Unpickler"},
    "cloudpickle": {"load", "loads"},
    "dill": {"load", "loads", "Unpickler"},
    "jsonpickle": {"decode"},
    "marshal": {"load", "loads"},
    "shelve": {"open", "Shelf", "DbfilenameShelf"},
    "yaml": {"unsafe_load", "unsafe_load_all", "full_load", "full_load_all", "UnsafeLoader"},
}
_SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _unsafe_call(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    module, _, attr = name.rpartition(".")
    if attr in _UNSAFE.get(module, ()):
        return name
    if name == "torch.load":
        weights_only = _keyword(call, "weights_only")
        if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
            return "torch.load without weights_only=True"
    if name in ("yaml.load", "yaml.load_all"):
        loader = _keyword(call, "Loader")
        if loader is None and len(call.args) > 1:
            loader = call.args[1]
        if loader is None or _dotted(loader).rpartition(".")[2] not in _SAFE_YAML_LOADERS:
            return f"{name} without a safe Loader"
    if name in ("np.load", "numpy.load"):
        allow = _keyword(call, "allow_pickle")
        if isinstance(allow, ast.Constant) and allow.value is True:
            return f"{name}(allow_pickle=True)"
    return None


def unsafe_deserialization(source: str) -> list[str]:
    """What in ``source`` could deserialize into arbitrary objects, one line per finding."""
    findings = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in _UNSAFE:
            bad = [a.name for a in node.names if a.name in _UNSAFE[node.module] or a.name == "*"]
            findings += [f"line {node.lineno}: from {node.module} import {b}" for b in bad]
        elif isinstance(node, ast.Call) and (what := _unsafe_call(node)) is not None:
            findings.append(f"line {node.lineno}: {what}")
    return findings


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\npickle.loads(data)",
        "import cloudpickle\ncloudpickle.load(f)",
        "from pickle import loads",
        "import marshal\nmarshal.loads(b)",
        "import shelve\nshelve.open('db')",
        "import torch\ntorch.load(path)",
        "import torch\ntorch.load(path, weights_only=False)",
        "import yaml\nyaml.load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.Loader)",
        "import yaml\nyaml.unsafe_load(text)",
        "import numpy as np\nnp.load(path, allow_pickle=True)",
    ],
)
def test_the_scan_catches_unsafe_deserialization(source: str) -> None:
    assert unsafe_deserialization(source) != []


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(path, weights_only=True)",
        "import yaml\nyaml.safe_load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
        "import pickle\npickle.dumps(obj)  # pickle.loads is mentioned only here",
        "import msgspec\nmsgspec.msgpack.decode(b)",
    ],
)
def test_the_scan_allows_safe_forms(source: str) -> None:
    assert unsafe_deserialization(source) == []


def test_no_project_module_deserializes_unsafely() -> None:
    findings = [
        f"{path.relative_to(ROOT)} {finding}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if not path.name.endswith("_pb2.py")
        for finding in unsafe_deserialization(path.read_text())
    ]
    assert findings == []
