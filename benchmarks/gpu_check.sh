#!/usr/bin/env bash
# The first run on a GPU machine: set-up from a folder of wheels, pytest -m cuda,
# race probes, pinning and pressure probes, the transfer benchmark and the demo,
# every figure as JSON into OUTDIR, all under 8 minutes. See benchmarks/gpu_check.py.
#
#   bash benchmarks/gpu_check.sh [--dry-run] OUTDIR [WHEELS_DIR]
#   PYTHON=/path/to/python3 bash benchmarks/gpu_check.sh OUTDIR WHEELS_DIR
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check.sh: no interpreter '$PY' (set PYTHON=...)" >&2
  exit 2
fi
cd "$HERE/.."
exec "$PY" "$HERE/gpu_check.py" --python "$PY" "$@"
