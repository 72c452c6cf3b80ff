"""Imports flow one way: kernels <- parallel <- engine <- cluster; the engine never imports Ray."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "kernels": {"parallel", "engine", "cluster", "ray"},
    "parallel": {"engine", "cluster", "ray"},
    "engine": {"cluster", "ray"},
}


def _imported_top_levels(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layer_never_imports_a_higher_one(package: str) -> None:
    bad = {
        str(path.relative_to(ROOT)): sorted(_imported_top_levels(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_ingress_and_the_cli_import_neither_torch_nor_transformers() -> None:
    """Every ingress replica imports these, and so do ``cluster status`` and ``shutdown``;
    torch and transformers would add ~3.5 s to each start (BENCHMARKS.md, start-up)."""
    import subprocess
    import sys

    code = (
        "import sys, cluster.serving.serve, cluster.ops.deploy, cluster.serving.token_channel, "
        "cluster.config; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
