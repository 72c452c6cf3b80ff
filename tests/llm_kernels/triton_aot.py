"""Ahead-of-time compilation of the Triton kernels for a CUDA target, without a GPU.

A test records the launches a wrapper makes (``record_launches``), turns each into a compile
job specialized the way ``JITFunction.run`` specializes a real launch (``compile_job``), and
hands the jobs to ``AotCompiler``: a child process running ``triton.compile`` down to PTX and,
through the wheel's ptxas, a cubin.

Why a child process: ``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated,
and that includes ``triton.language``'s own (``tl.cdiv``, ``tl.max``, ``tl.sum``, ...). Once a
process has imported triton with the interpreter on (tests/conftest.py without CUDA), its
kernels and those library functions are interpreter objects that the compiler cannot lower.
The child imports triton and the kernels afresh with the interpreter off.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Launch options a wrapper passes next to the kernel's own arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
REPO_ROOT = Path(__file__).resolve().parents[2]

SM80, SM90 = 80, 90
# Dynamic shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin): more and
# the launch fails with "out of resource", which the compiler itself does not check.
MAX_SHARED_BYTES = {SM80: 163 * 1024, SM90: 227 * 1024}


@dataclass
class Launch:
    """One launch as a wrapper made it: the kernel's module and name, arguments by name, and
    launch options (``num_warps``, ...)."""

    module: str
    kernel: str
    args: dict[str, Any]
    options: dict[str, Any]


def record_launches(
    monkeypatch: pytest.MonkeyPatch, modules: Iterable[ModuleType], call: Callable[[], object]
) -> list[Launch]:
    """The kernel launches ``call`` makes through the kernels of ``modules``, none of them run.

    Each kernel's ``run`` (what ``kernel[grid](...)`` calls) is replaced by a recorder; the
    kernel objects themselves stay, so ``interpreter_enabled()`` and the wrappers' device
    checks see what they always see.
    """
    from triton.runtime.jit import KernelInterface  # JITFunction and InterpretedFunction

    launches: list[Launch] = []
    for module in modules:
        for name, kernel in vars(module).items():
            if not isinstance(kernel, KernelInterface):
                continue

            def run(*args, grid, warmup, _module=module, _name=name, _fn=kernel.fn, **kwargs):
                options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
                bound = inspect.signature(_fn).bind(*args, **kwargs)
                launches.append(Launch(_module.__name__, _name, dict(bound.arguments), options))

            monkeypatch.setattr(kernel, "run", run)
    call()
    return launches


def compile_job(launch: Launch, arch: int) -> dict[str, Any]:
    """The launch as a JSON-able ``triton.compile`` job for ``sm_<arch>``.

    Arguments are specialized by triton's own launch-time rule: an int equal to 1 becomes a
    constant, ints and pointers divisible by 16 get ``tt.divisibility = 16``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    backend = make_backend(GPUTarget("cuda", arch, 32))
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: list[tuple[int, str]] = []
    fn_params = inspect.signature(_kernel_fn(launch)).parameters.values()
    for index, param in enumerate(fn_params):
        value = launch.args[param.name]
        if _is_constexpr(param):
            kind, spec = "constexpr", None
        else:
            # is_const=False, specialize=True, align=True: what run() passes by default.
            kind, spec = native_specialize_impl(backend, value, False, True, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = value
        elif spec:
            attrs.append((index, spec))
    return {
        "module": launch.module,
        "kernel": launch.kernel,
        "signature": signature,
        "constexprs": constexprs,
        "attrs": attrs,
        "options": launch.options,
        "arch": arch,
    }


def _kernel_fn(launch: Launch) -> Callable[..., Any]:
    return getattr(importlib.import_module(launch.module), launch.kernel).fn


def _is_constexpr(param: inspect.Parameter) -> bool:
    # The kernels' annotations are strings ("tl.constexpr") under postponed evaluation.
    return "constexpr" in str(param.annotation)


class AotCompiler:
    """A child process that compiles jobs one at a time; ``compile`` returns its answer:
    ``ptx``, ``cubin_size``, ``shared`` (bytes), ``registers`` and ``stack_bytes`` (per
    thread), or ``error``."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        # Kept open as long as the child, which writes to it; closed by close().
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self._child = subprocess.Popen(
            [sys.executable, "-m", "tests.llm_kernels.triton_aot"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=REPO_ROOT,
            env=env,
            text=True,
        )

    def compile(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(json.dumps(job) + "\n")
        self._child.stdin.flush()
        line = self._child.stdout.readline()
        if not line:
            self._stderr.seek(0)
            raise RuntimeError(
                f"AOT compile child exited with {self._child.wait()}; its stderr ends:\n"
                f"{self._stderr.read()[-4000:]}"
            )
        return json.loads(line)

    def close(self) -> None:
        # Killed rather than let exit: the child keeps nothing, and torch's and triton's
        # interpreter teardown takes seconds.
        self._child.kill()
        self._child.wait()
        for pipe in (self._child.stdin, self._child.stdout, self._stderr):
            if pipe is not None:
                pipe.close()


def _compile_in_child(job: dict[str, Any]) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", job["arch"], 32)
    backend = make_backend(target)
    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    attrs = {(index,): backend.parse_attr(spec) for index, spec in job["attrs"]}
    source = ASTSource(kernel, job["signature"], job["constexprs"], attrs)
    compiled = triton.compile(source, target=target, options=job["options"])
    return {
        "ptx": compiled.asm["ptx"],
        "cubin_size": len(compiled.asm["cubin"]),
        "shared": compiled.metadata.shared,
        **_resource_usage(compiled.asm["cubin"]),
    }


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and stack frame bytes per thread (register spills land in the stack frame) of
    the cubin's kernel, as ``cuobjdump -res-usage`` reports them."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cuobjdump = triton.knobs.nvidia.cuobjdump.path
        report = subprocess.run(
            [cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", report)
    if usage is None:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{report}")
    return {"registers": int(usage.group(1)), "stack_bytes": int(usage.group(2))}


def main() -> None:
    """The child: one JSON job per stdin line, one JSON answer per stdout line. Anything else
    the compiler prints goes to stderr, so it cannot break the protocol."""
    answers = sys.stdout
    sys.stdout = sys.stderr
    for line in sys.stdin:
        try:
            answer = _compile_in_child(json.loads(line))
        except Exception as e:  # the compile error is the test's failure message
            answer = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
