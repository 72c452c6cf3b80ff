#!/usr/bin/env bash
# Download, on a machine with package-index access, the wheels that the engine imports and that a
# bare GPU machine (no package index) may lack, into .whl/ (git-ignored): msgspec (the wire
# types) and xgrammar (structured outputs) with their dependencies. scripts/gpu-check.sh installs
# them from there, offline, when they are not importable. Targets CPython 3.12 on x86-64 Linux
# (the device image's python3); pins the versions this checkout's .venv runs, else the listed ones.
#
#   bash scripts/gpu-wheels.sh            # then carry .whl to the GPU machine with the checkout
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
declare -A FALLBACK=(
  [msgspec]=0.22.0 [xgrammar]=0.2.8 [apache-tvm-ffi]=0.1.15.post2 [pydantic]=2.14.4
  [pydantic-core]=2.50.5 [annotated-types]=0.8.0 [typing-inspection]=0.4.5
)
version_of() {
  local v=""
  if [ -x .venv/bin/python ]; then
    v=$(.venv/bin/python -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')
  fi
  echo "${v:-${FALLBACK[$1]}}"
}
mkdir -p .whl
for name in "${!FALLBACK[@]}"; do
  spec="$name==$(version_of "$name")"
  echo "gpu-wheels: $spec"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$spec"
done
du -sh .whl
