#!/usr/bin/env bash
# CUDA compile check that needs no GPU: builds csrc/ with the CUDA kernel (FLASHRT_CUDA=ON) using
# nvcc from NVIDIA's pip wheels (CUDA 13.5: nvcc, nvvm, crt, runtime, cccl; ~350 MB, installed once
# into build/cuda-toolkit), for sm_80 and sm_90, nvcc warnings as errors and ptxas spill/local-memory
# warnings on; then imports the module and checks that the CUDA entry point is compiled in, that
# each architecture has machine code, and that a launch without a driver fails with a clear error.
# Nothing runs on a GPU. Not part of CI (the download); about 1-2 minutes on 2 cores once installed.
#
#   scripts/cuda_compile_check.sh [TOOLKIT_DIR]     # TOOLKIT_DIR: reuse wheels installed there
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
TK=${1:-$ROOT/build/cuda-toolkit}
BUILD=$ROOT/build/cuda-compile-check
CUDA=$TK/nvidia/cu13
T0=$(date +%s)
fail() { echo "cuda compile check FAILED: $*" >&2; exit 1; }

if [ ! -x "$CUDA/bin/nvcc" ] || [ ! -x "$CUDA/nvvm/bin/cicc" ]; then
  echo "== installing the CUDA 13.5 compiler wheels into $TK"
  # one pip call: --target skips packages whose top-level folder (nvidia/) already exists
  "$PY" -m pip install -q --no-deps --target "$TK" "nvidia-cuda-nvcc==13.5.37" "nvidia-nvvm==13.5.37" \
      "nvidia-cuda-crt==13.5.37" "nvidia-cuda-runtime==13.5.37" "nvidia-cuda-cccl==13.3.5.0.6" \
      || fail "pip could not install the CUDA wheels"
fi
# FindCUDAToolkit looks for the unversioned name; the wheel ships libcudart.so.13 only
ln -sf libcudart.so.13 "$CUDA/lib/libcudart.so"
"$CUDA/bin/nvcc" --version | tail -n 2

echo "== configure (FLASHRT_CUDA=ON, sm_80;sm_90)"
NINJA=$("$PY" -c "import ninja, os; print(os.path.join(ninja.BIN_DIR, 'ninja'))" 2>/dev/null) || NINJA=ninja
rm -rf "$BUILD"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA" -DFLASHRT_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$CUDA/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA" -DCMAKE_CUDA_ARCHITECTURES="80;90" \
    -DCMAKE_CUDA_FLAGS="-Werror all-warnings -Xptxas -warn-spills,-warn-lmem-usage" \
    -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" >"$BUILD.configure.log" 2>&1 \
    || { tail -n 30 "$BUILD.configure.log"; fail "cmake configure"; }
grep -q "CUDA kernel built: ON" "$BUILD.configure.log" || fail "configure did not enable the CUDA kernel"

echo "== build"
cmake --build "$BUILD" 2>&1 | tail -n 20
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "build"

echo "== checks"
(cd "$BUILD" && "$PY" - <<'PY') || fail "module checks"
import numpy as np
import _C
assert _C.has_cuda(), "module built without copy_segments_cuda"
one = lambda v: np.array([v], dtype=np.int64)
try:   # no GPU driver here: the launch must fail as a Python error, not a crash
    _C.copy_segments_cuda(one(4096), one(8192), one(64), 0)
except RuntimeError as e:
    print("launch without a driver:", e)
else:
    raise AssertionError("copy_segments_cuda returned without a CUDA driver")
PY
CUOBJDUMP=$("$PY" -c "import triton, os; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'))" 2>/dev/null)
if [ -x "${CUOBJDUMP:-}" ]; then   # Triton's wheel carries cuobjdump
  ELF=$("$CUOBJDUMP" --list-elf "$BUILD"/_C*.so)
  echo "$ELF"
  for a in sm_80 sm_90; do grep -q "$a" <<<"$ELF" || fail "no $a machine code in the module"; done
else
  echo "(cuobjdump not found: machine-code listing skipped)"
fi
echo "cuda compile check passed in $(( $(date +%s) - T0 ))s"
