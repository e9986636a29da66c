#!/usr/bin/env bash
# GPU check for a CUDA machine without network access.
#
# Expects Python 3.12+, torch (CUDA build), transformers, pybind11, scikit-build-core,
# cuda-bindings and nvcc already installed. Builds and installs FlashRT with its CUDA extension,
# runs the CUDA/graph tests, then short CUDA benchmarks (random weights) and prints their
# tables. The whole script stays under ~8 minutes: every step runs under `timeout`, capped by
# what is left of the overall deadline (GPU_CHECK_BUDGET_S, default 470 s).
#
#   bash bench/gpu_check.sh            # results in bench/results/*-cuda*.json (+ $OUT if set)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUDGET=${GPU_CHECK_BUDGET_S:-470}
T0=$(date +%s)
FAILED=()
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PYTHONUNBUFFERED=1

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() {   # cap SECONDS: the smaller of SECONDS and what is left of the budget (at least 1)
  local l; l=$(left)
  if (( l < 1 )); then l=1; fi
  if (( $1 < l )); then echo "$1"; else echo "$l"; fi
}
banner() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $* ==="; }
# soft SECONDS NAME CMD...: a benchmark step; a failure or timeout is recorded, the script goes on
soft() {
  local secs=$1 name=$2; shift 2
  banner "$name (timeout $(cap "$secs")s)"
  if (( $(left) < 15 )); then echo "skipped: overall budget spent"; FAILED+=("$name (skipped)"); return 0; fi
  local rc=0
  timeout "$(cap "$secs")" "$@" || rc=$?
  if (( rc != 0 )); then echo "!! $name failed (rc=$rc; 124 = timeout)"; FAILED+=("$name rc=$rc"); fi
  return 0
}

banner "nvidia-smi"
timeout 30 nvidia-smi

banner "build + install (CUDA extension)"
timeout "$(cap 200)" pip install --no-build-isolation --no-deps . 2>&1 | tail -n 15

banner "native extension status (installed package)"
# run outside the checkout so the installed package (with _C) is the one imported
(cd / && timeout 60 python -c "import flashrt.native as n; print(n.ext_status()); assert n.HAVE_EXT and n.HAVE_CUDA_EXT, 'CUDA extension missing'")

banner "tests: cuda or graph"
# the pytest script (not python -m pytest) keeps the checkout off sys.path: the installed
# package, extension included, is what the tests import
timeout "$(cap 150)" pytest -q tests -k "cuda or graph" -p no:cacheprovider

soft 150 "checkpoints (random weights, real shapes)" python -c "
import sys, time; sys.path.insert(0, '$ROOT')
from bench import common as C
for a in ('qwen3', 'qwen3_5', 'lfm2'):
    t = time.time(); p = C.checkpoint(a, 'real'); print(a, p, f'{time.time() - t:.0f}s', flush=True)
"

soft 75 "models: prefill/decode vs transformers (bf16, real shapes)" \
  python bench/models.py --device cuda --dtype bfloat16 --arch qwen3,qwen3_5 --size real \
    --prefill 512 2048 --repeats 3 --decode-steps 16 --no-progress

soft 60 "capsules on cuda (device, host, disk tiers)" \
  python bench/capsules.py --device cuda --dtype bfloat16 --arch qwen3,qwen3_5 --size real \
    --mib 1 16 256 1024 --repeats 3 --no-progress

for m in qwen3_5 qwen3 lfm2; do
  soft 90 "ttft $m real (2k-16k)" \
    python bench/ttft.py --device cuda --dtype bfloat16 --models "$m:real" \
      --prefix 2048 4096 8192 16384 --repeats 2 --warmup 1 --no-progress \
      --out "bench/results/ttft-cuda-$m.json" --plot "bench/results/ttft-cuda-$m.png"
done

if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  cp bench/results/*cuda* "$OUT"/ 2>/dev/null || true
fi

banner "done in $(( $(date +%s) - T0 ))s"
if (( ${#FAILED[@]} )); then
  printf 'failed or skipped: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all steps passed"
