#!/usr/bin/env bash
# Download (on a machine with network) every wheel that benchmarks/gpu_check.sh
# may need on a GPU machine without network whose python3 already has CUDA
# torch and numpy: the project's runtime and test dependencies beyond those,
# with their own dependencies, for CPython 3.11 and 3.12 on manylinux x86_64.
#
#   bash scripts/gpu_wheels.sh DIR            download into DIR (created)
#   bash scripts/gpu_wheels.sh --print DIR    print the pip commands, download nothing
#
# Then carry DIR to the GPU machine:  bash benchmarks/gpu_check.sh OUT DIR
# Wheels are never committed.
set -euo pipefail
PRINT=0
if [ "${1:-}" = "--print" ]; then PRINT=1; shift; fi
DIR="${1:-}"
if [ -z "$DIR" ]; then
  echo "usage: gpu_wheels.sh [--print] DIR" >&2
  exit 2
fi
PY="${PYTHON:-python3}"
# Runtime (pyproject dependencies) and test/extra needs, less torch and numpy,
# which the GPU machine brings in its own CUDA builds. crc32c is zarr's optional
# crc32c codec backend; google-crc32c and crc32c-rs (the disk tier's fast checksum) are ours.
PACKAGES=(
  "zarr>=3.0" numcodecs donfig crc32c google-crc32c "crc32c-rs>=0.0.7" typing-extensions packaging
  "nvidia-ml-py>=12.0" "tqdm>=4.60" "matplotlib>=3.7" "psutil>=5.9"
  "pytest>=7.4" "pytest-xdist>=3.3" "pytest-timeout>=2.2" "hypothesis>=6.80"
  "prometheus-client>=0.17" "ruff>=0.4"
)
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64)
mkdir -p "$DIR"
for V in 3.11 3.12; do
  CMD=("$PY" -m pip download --dest "$DIR" --only-binary=:all: --python-version "$V"
       --implementation cp "${PLATFORMS[@]}" "${PACKAGES[@]}")
  if [ "$PRINT" = 1 ]; then
    printf '%q ' "${CMD[@]}"; echo
  else
    echo "gpu_wheels: CPython $V"
    "${CMD[@]}"
  fi
done
if [ "$PRINT" = 0 ]; then
  # numpy comes along as a dependency; the GPU machine keeps its own
  rm -f "$DIR"/numpy-*.whl
  echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR"
fi
