#!/bin/sh
# Install torch into the given interpreter without pulling a CUDA build onto a
# CPU-only machine. A torch that is already importable (for example a CUDA
# build the machine came with) is kept as it is.
#
#   sh scripts/install_torch.sh PYTHON               install torch if missing
#   sh scripts/install_torch.sh --cuda-extra PYTHON  print the pyproject extra whose cupy
#                                                   matches PYTHON's torch CUDA build
#                                                   (cuda12 or cuda13; nothing for a CPU
#                                                   torch or another CUDA major)
set -e
if [ "$1" = "--cuda-extra" ]; then
  PYBIN="$2"
  if [ -z "$PYBIN" ]; then
    echo "usage: install_torch.sh --cuda-extra PYTHON" >&2
    exit 2
  fi
  # torch.version.cuda is None for a CPU build, "12.8" / "13.0" for CUDA builds
  CUDA_VERSION=$("$PYBIN" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null) || {
    echo "install_torch.sh: $PYBIN cannot import torch; no cuda extra" >&2
    exit 0
  }
  case "$CUDA_VERSION" in
    "") ;;  # CPU torch: no cupy
    12|12.*) echo "cuda12" ;;
    13|13.*) echo "cuda13" ;;
    *) echo "install_torch.sh: no cupy extra for torch's CUDA $CUDA_VERSION;" \
            "exact-size pinning uses torch's cudart instead" >&2 ;;
  esac
  exit 0
fi
PYBIN="$1"
if [ -z "$PYBIN" ]; then
  echo "usage: install_torch.sh PYTHON | --cuda-extra PYTHON" >&2
  exit 2
fi
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
