#!/bin/sh
# Install torch into the given interpreter without pulling a CUDA build onto a
# CPU-only machine. A torch that is already importable (for example a CUDA
# build the machine came with) is kept as it is.
set -e
PYBIN="$1"
if "$PYBIN" -c "import torch" 2>/dev/null; then
  echo "torch already present: $("$PYBIN" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "GPU found: installing a CUDA build of torch"
  "$PYBIN" -m pip install -q "torch>=2.1"
else
  echo "no GPU: installing the CPU build torch==2.13.0"
  "$PYBIN" -m pip install -q "torch==2.13.0"
fi
