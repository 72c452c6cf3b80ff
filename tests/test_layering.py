"""Imports flow one way: llm_kernels <- parallel <- engine <- cluster; the engine never imports Ray.
Inside cluster: api <- config <- runtime <- serving <- ops <- bench <- cli. No import inside a
function closes an import cycle."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "llm_kernels": {"parallel", "engine", "cluster", "ray"},
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


# Inside ``cluster``, bottom to top: each part imports only from its own layer and those below
# (the order is written out in cluster/__init__.py and the README's Layout).
CLUSTER_LAYERS: dict[str, int] = {
    "api": 0,
    "proto": 0,
    "config": 1,
    "runtime": 2,
    "serving": 3,
    "ops": 4,
    "bench": 5,
    "cli": 6,
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cluster_layer(module: str) -> str | None:
    """The layer of ``cluster.<part>...`` (``cluster.config.X`` is layer config)."""
    part = module.split(".")[1]
    return part if part in CLUSTER_LAYERS else None


def _imported_cluster_modules(source: str, package: str) -> set[str]:
    """Every ``cluster...`` name the source of a module in ``package`` imports, at module level
    or inside a function: ``from cluster import x`` counts as ``cluster.x``, and relative
    imports are resolved against ``package``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("cluster.")}


def _upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The ``cluster`` modules that ``module`` (with this source) imports from above its layer."""
    own = CLUSTER_LAYERS[_cluster_layer(module) or ""]
    package = module if is_package else module.rpartition(".")[0]
    return sorted(
        name
        for name in _imported_cluster_modules(source, package)
        if (layer := _cluster_layer(name)) is not None and CLUSTER_LAYERS[layer] > own
    )


def _cluster_modules() -> dict[str, pathlib.Path]:
    """Every module under cluster/, by dotted name, but the package's own empty ``__init__``."""
    paths = (ROOT / "cluster").rglob("*.py")
    return {_module_name(p): p for p in sorted(paths) if _module_name(p) != "cluster"}


def test_every_cluster_module_belongs_to_a_layer() -> None:
    assert [name for name in _cluster_modules() if _cluster_layer(name) is None] == []


@pytest.mark.parametrize("layer", sorted(CLUSTER_LAYERS, key=CLUSTER_LAYERS.__getitem__))
def test_a_cluster_layer_imports_only_its_own_layer_and_those_below(layer: str) -> None:
    upward = {
        str(path.relative_to(ROOT)): _upward_imports(
            path.read_text(), name, is_package=path.name == "__init__.py"
        )
        for name, path in _cluster_modules().items()
        if _cluster_layer(name) == layer
    }
    assert {k: v for k, v in upward.items() if v} == {}


def test_the_layer_check_sees_imports_inside_functions_and_relative_ones() -> None:
    source = (
        "from cluster.config import load_config\n"
        "from . import placement\n"
        "def start():\n"
        "    from cluster import serving\n"
        "    from cluster.ops import deploy\n"
        "    from ..serving.serve import build_app\n"
    )
    assert _upward_imports(source, "cluster.runtime.probe") == [
        "cluster.ops",
        "cluster.ops.deploy",
        "cluster.serving",
        "cluster.serving.serve",
        "cluster.serving.serve.build_app",
    ]


def _project_imports(path: pathlib.Path, module: str) -> tuple[set[str], set[str]]:
    """The project modules ``module`` imports at module level (``if TYPE_CHECKING`` blocks left
    out) and those it imports inside functions, as dotted names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top: set[str] = set()
    late: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = _imported_names(node, package)
            (late if in_function else top).update(names)
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return top, late


def _imported_names(node: ast.Import | ast.ImportFrom, package: str) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1] if node.level else []
    module = ".".join(base + ([node.module] if node.module else []))
    return {module} | {f"{module}.{alias.name}" for alias in node.names}


def _import_cycles_closed_late(modules: dict[str, pathlib.Path]) -> list[str]:
    """``a -> b`` for each import inside a function of ``a`` whose target ``b`` reaches ``a``
    again through module-level imports (a package's ``__init__`` counts as imported with it):
    an import moved into a function only to break a cycle."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    top: dict[str, set[str]] = {}
    late: dict[str, set[str]] = {}
    for module, path in modules.items():
        eager, lazy = _project_imports(path, module)
        top[module] = {m for n in eager if (m := known(n)) and m != module}
        late[module] = {m for n in lazy if (m := known(n)) and m != module}
        parent = module.rpartition(".")[0]
        if parent in modules:
            top[module].add(parent)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for nxt in top[todo.pop()]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return sorted(f"{a} -> {b}" for a in modules for b in late[a] if reaches(b, a))


def test_no_import_inside_a_function_closes_an_import_cycle() -> None:
    """Cycles are broken by moving the shared piece down, not by deferring an import. Imports
    inside functions stay for start-up time or optional packages (Triton, PEFT)."""
    modules = {
        _module_name(p): p
        for package in ("llm_kernels", "parallel", "engine", "cluster")
        for p in sorted((ROOT / package).rglob("*.py"))
    }
    assert _import_cycles_closed_late(modules) == []


def test_the_cycle_check_sees_a_cycle_closed_inside_a_function(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from pkg import b\n")
    (tmp_path / "b.py").write_text("from pkg.a import f\n")
    (tmp_path / "c.py").write_text("def g():\n    from pkg import a\n")
    modules = {f"pkg.{name}": tmp_path / f"{name}.py" for name in "abc"}
    assert _import_cycles_closed_late(modules) == ["pkg.a -> pkg.b"]


def test_the_ingress_and_the_cli_import_neither_torch_nor_transformers() -> None:
    """Every ingress replica imports these, and so do the CLI's commands, whose command lines
    are parsed here too: ``status`` and ``shutdown`` never import torch or transformers, which
    would add ~3.5 s to each start (BENCHMARKS.md, start-up); ``serve`` and ``deploy`` only to
    check the config."""
    import subprocess
    import sys

    code = (
        "import sys, cluster.serving.serve, cluster.ops.deploy, cluster.serving.token_channel, "
        "cluster.config, cluster.cli; "
        "[cluster.cli.build_parser(a).parse_args(a) for a in (['serve', 'c.yaml'], "
        "['deploy', 'c.yaml'], ['status'], ['shutdown'])]; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
