#!/usr/bin/env bash
# The test suite under the GPU image's package versions, on a machine without a GPU: a side venv
# with that image's torch (its CUDA wheel: imports and runs on CPU), Triton, transformers and
# NumPy, flashrt built into it with the CUDA kernel (sm_90, as bench/gpu_check.sh builds it), then
# the whole suite. A version difference that would fail on the lent GPU fails here first, at no
# device time. Not part of CI (a ~3 GB download); ~2 min to install, ~4 min of tests on 2 cores.
#
#   scripts/image_versions_check.sh [VENV_DIR]      # default build/image-venv (reused when there)
# Versions: the device image's as read in /work/.library/device/KINDS.md (2026-11); override with
# PYTHON=/path/to/python3.12 TORCH=2.11.0 TRITON=3.6.0 TRANSFORMERS=5.17.0 NUMPY=2.5.5.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-$PWD/build/image-venv}
PYTHON=${PYTHON:-$(command -v python3.12 || echo python3)}
TORCH=${TORCH:-2.11.0} TRITON=${TRITON:-3.6.0} TRANSFORMERS=${TRANSFORMERS:-5.17.0} NUMPY=${NUMPY:-2.5.5}
fail() { echo "image versions check FAILED: $*" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || fail "no venv from $PYTHON (set PYTHON= to a python3.12)"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH" "triton==$TRITON" "transformers==$TRANSFORMERS" \
      "numpy==$NUMPY" "scikit-build-core>=0.10" "pybind11>=2.12" ninja "safetensors>=0.4" pytest \
      matplotlib tqdm "redis>=5" "fastapi>=0.110" "uvicorn>=0.29" "jinja2>=3.1" "tokenizers>=0.19" \
      "openai>=1.30" "httpx>=0.27" || fail "pip install"
fi
PY=$VENV/bin/python
"$PY" -c "import sys, torch, triton, transformers, numpy; print(sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
# the CUDA kernel needs nvcc on PATH; without one the CPU extension is built (as gpu_check falls back)
CUDA=OFF; command -v nvcc >/dev/null 2>&1 && CUDA=ON
"$PY" -m pip install -q --no-build-isolation --no-deps -C cmake.define.FLASHRT_CUDA=$CUDA \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 . || fail "build (FLASHRT_CUDA=$CUDA)"
(cd / && "$PY" -c "import flashrt.native as n; print(n.ext_status())") || fail "import"
cd tests && "$PY" -m pytest -q -p no:cacheprovider . || fail "tests"
echo "image versions check passed"
