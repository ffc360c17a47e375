#!/usr/bin/env bash
# Create the virtual environment overlapc's demo, tests and benchmarks run in.
#
# - Where a torch >= 2.11 is already importable by $PYTHON, the venv sees it
#   (--system-site-packages) and keeps it: no torch is installed.
# - Otherwise it installs torch==2.13.0 (the CPU wheel this machine holds on local disk)
#   and triton==3.7.1. torch is always named with an exact version: an unpinned torch
#   would pull a multi-GB CUDA build.
# - overlapc itself is installed editable with --no-deps, so pip never resolves torch.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}

has_torch() {  # $1: python; succeeds if it imports torch >= 2.11
  "$1" - <<'PY' 2>/dev/null
import sys
import torch
major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
}

if [ ! -x "$VENV/bin/python" ]; then
  if has_torch "$PYTHON"; then
    echo "setup: keeping the installed torch ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)

if ! has_torch "$PY"; then
  echo "setup: installing torch==2.13.0 (CPU) and triton==3.7.1"
  "${PIP[@]}" "torch==2.13.0" "triton==3.7.1"
fi
if ! "$PY" -c "import triton" 2>/dev/null; then
  echo "setup: installing triton"
  "${PIP[@]}" triton
fi
"${PIP[@]}" sympy networkx pytest hypothesis matplotlib "ruff==0.17.6"
# Real clients the tests load models with (optional: tests skip without them). torch is
# already installed, so pip resolves their torch requirement to it.
"${PIP[@]}" "transformers==5.25.0" "accelerate==1.16.0"
"${PIP[@]}" --no-deps --editable .
# Without CUDA the fused kernels run in Triton's interpreter; Triton < 3.7's (beside torch
# 2.11) cannot run them on NumPy >= 2.4: give the venv a NumPy it can.
if "$PY" - <<'PY' 2>/dev/null
import sys
import numpy, torch, triton
from overlapc.kernels import interpreter_problem
sys.exit(0 if not torch.cuda.is_available() and interpreter_problem(triton.__version__, numpy.__version__) else 1)
PY
then
  echo "setup: installing numpy<2.4 (Triton $("$PY" -c 'import triton; print(triton.__version__)')'s interpreter)"
  "${PIP[@]}" "numpy<2.4"
fi
"$PY" -c "import torch, triton, overlapc; print(f'setup: torch {torch.__version__}, triton {triton.__version__}, overlapc {overlapc.__version__}')"
