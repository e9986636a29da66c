#!/usr/bin/env bash
# GPU check for a lent CUDA machine without network: one call of at most BUDGET_S, build included.
#   stage 1 (at most STAGE1_S): nvidia-smi, build + install with the CUDA extension, extension
#           check, CUDA tests;
#   stage 2: benchmarks in order of value (random weights, real shapes, bf16).
# Every step is soft: it runs under `timeout` with its declared cap, cut to what is left of its
# stage and of the budget; its status is recorded and the script goes on. The declared caps, one
# kill grace and one publish per step, and the reserve add up within the budget (stage 1 within
# STAGE1_S); tests/test_gpu_check_budget.py checks that arithmetic on CPU, so it cannot drift.
# Expects python3 with torch (CUDA), triton, transformers, pybind11, scikit-build-core, cmake,
# ninja and nvcc. Results: bench/results/*-cuda*.json and tables, gpu_check.log and
# gpu_check-summary.json; with $OUT set, the log, the summary and a tarball of all of them in
# $OUT (3 files, refreshed after every step, so a call cut short still brings them back).
#
#   bash bench/gpu_check.sh [--plan] [--results DIR]
#     --plan     record every step as planned (nothing runs): the table and summary, for the tests
#     --results  where results go (default bench/results)
set -uo pipefail          # no -e: one failing step must not skip the rest
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$(command -v python3)
PLAN=0
RES=bench/results
while (( $# )); do
  case $1 in
    --plan) PLAN=1; shift ;;
    --results) RES=$2; shift 2 ;;
    *) echo "usage: bash bench/gpu_check.sh [--plan] [--results DIR]" >&2; exit 2 ;;
  esac
done
BUDGET_S=420              # the whole call, build included
STAGE1_S=180              # build, extension check, CUDA tests
RESERVE_S=15              # summary, tarball and copies to $OUT after the last step
KILL_S=2                  # timeout -k: a step that ignores SIGTERM is killed this much later
PUBLISH_S=1               # after each step: summary and copies to $OUT
LOG=$RES/gpu_check.log
STEPS=$RES/gpu_check-steps.tsv
T0=$(date +%s)
mkdir -p "$RES"
: >"$STEPS"
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)

now() { echo $(( $(date +%s) - T0 )); }

summary() {   # the steps table as JSON, with the machine and versions
  "$PY" - "$STEPS" "$RES/gpu_check-summary.json" "$BUDGET_S" "$STAGE1_S" "$(now)" <<'PY' || true
import json, subprocess, sys
steps_path, out, budget, stage1, elapsed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
keys = ("stage", "name", "cap_s", "timeout_s", "status", "rc", "seconds")
steps = [dict(zip(keys, l.rstrip("\n").split("\t"))) for l in open(steps_path) if l.strip()]
for s in steps:
    for k in ("stage", "cap_s", "timeout_s", "rc", "seconds"):
        s[k] = int(s[k])
def q(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:
        return f"unavailable: {e}"
machine = {"gpu": q(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]),
           "versions": q([sys.executable, "-c", "import torch, triton; print(torch.__version__, "
                          "torch.version.cuda, 'triton', triton.__version__)"])}
json.dump({"budget_s": budget, "stage1_cap_s": stage1, "elapsed_s": elapsed, "machine": machine,
           "ok": sum(s["status"] == "ok" for s in steps),
           "steps": steps}, open(out, "w"), indent=1)
PY
}

publish() {   # copy what exists so far to $OUT (at most 8 files come back from there)
  summary
  [[ -n "${OUT:-}" && -d "${OUT:-}" ]] || return 0
  cp "$LOG" "$RES/gpu_check-summary.json" "$OUT"/ 2>/dev/null
  tar -czf "$OUT/gpu_check-results.tar.gz" $RES/*cuda* $RES/gpu_check* 2>/dev/null
  return 0
}

# step STAGE CAP NAME CMD...: run CMD under timeout min(CAP, left of the stage, left of the budget)
step() {
  local stage=$1 cap=$2 name=$3; shift 3
  local end=$(( BUDGET_S - RESERVE_S ))
  if (( stage == 1 && STAGE1_S < end )); then end=$STAGE1_S; fi
  local t=$(( end - $(now) )) start rc status
  if (( cap < t )); then t=$cap; fi
  start=$(now)
  echo; echo "=== [${start}s] stage $stage: $name (cap ${cap}s, timeout ${t}s) ==="
  if (( PLAN )); then
    status=planned rc=0
  elif (( t < 5 )); then
    status=skipped rc=-1; echo "skipped: its stage or the budget is spent"
  else
    timeout -k "$KILL_S" "$t" "$@"
    rc=$?
    case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
    [[ $status == ok ]] || echo "!! $name: $status (rc=$rc)"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$stage" "$name" "$cap" "$t" "$status" "$rc" \
    "$(( $(now) - start ))" >>"$STEPS"
  publish
}

# functions run under `timeout` through a child bash, so they and what they use are exported
ckpt() { "$PY" -c "import sys; sys.path.insert(0, '$ROOT'); from bench import common as C; print(C.checkpoint('$1', 'real'))"; }
ttft() {
  "$PY" bench/ttft.py --device cuda --dtype bfloat16 --models "$1:real" --prefix 2048 4096 8192 16384 \
    --repeats 2 --warmup 1 --no-progress --out "$RES/ttft-cuda-$1.json" --plot "$RES/ttft-cuda-$1.png"
}
build() {
  "$PY" -m pip install -q --no-build-isolation --no-deps -C cmake.define.FLASHRT_CUDA=ON \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 . && return 0
  echo "!! CUDA build failed: installing without the CUDA kernel so the later steps run"
  "$PY" -m pip install -q --no-build-isolation --no-deps -C cmake.define.FLASHRT_CUDA=OFF .
  return 1
}
export PY ROOT RES
export -f ckpt ttft build

# ---- stage 1: build, extension, CUDA tests --------------------------------------------------
step 1 5 "nvidia-smi" nvidia-smi
# sm_90 only (the H100/H200): half the nvcc time of the default 80;90. ON: fail loudly without
# nvcc, then install without the CUDA kernel (the step still fails) so the later steps can run.
step 1 75 "build + install (CUDA extension)" bash -c build
# from / and tests/: the installed package (extension included) is imported, not the checkout
step 1 8 "extension check" bash -c "cd / && '$PY' -c \"import flashrt.native as n; print(n.ext_status()); \
assert n.HAVE_EXT and n.HAVE_CUDA_EXT, 'CUDA extension missing'\""
# two steps: a timeout in the Triton tests (each kernel variant compiles on first use) must not
# lose the runtime's results
step 1 45 "CUDA tests: graphs, capsules" bash -c "cd tests && '$PY' -m pytest -q -rfEs --tb=short \
  -p no:cacheprovider test_cuda.py test_qwen3_5.py test_capture_check.py -k cuda"
# the CUDA segment-copy tests (a few seconds) first: a Triton compile timeout must not lose them
step 1 30 "CUDA tests: segment copy, Triton decode attention" bash -c "cd tests && '$PY' -m pytest \
  -q -rfEs --tb=short -p no:cacheprovider test_native.py test_decode_attention.py -k cuda"

# ---- stage 2: benchmarks, most valuable first (qwen3_5 only: qwen3 and lfm2 do not fit) --------
step 2 28 "checkpoint qwen3_5 real (random weights)" bash -c "ckpt qwen3_5"
step 2 61 "ttft qwen3_5 real: capsule vs cold, 2k-16k" bash -c "ttft qwen3_5"
# positions 1 (the 19.6 MiB fixed state alone), 1024 and 16384 (the issue's 0.5 ms target). No
# disk tier: ~3 GB of fsync'd writes at 16k would risk the cap, and the JSON is written per size
step 2 26 "capsules qwen3_5 on cuda: device/host tiers, 1-16k tokens" "$PY" bench/capsules.py \
  --device cuda --dtype bfloat16 --arch qwen3_5 --size real --mib 1 --tokens 1024 16384 --no-disk \
  --repeats 3 --no-progress \
  --out "$RES/capsules-cuda.json"
step 2 15 "policy smolvla small on cuda: chunk stages, control rate, reset" "$PY" bench/policy.py \
  --device cuda --size small --repeats 3 --lerobot-python "" --no-progress --out "$RES/policy-cuda.json"
step 2 25 "models qwen3_5: graph vs eager, vs transformers" "$PY" bench/models.py --device cuda \
  --dtype bfloat16 --arch qwen3_5 --size real --prefill 512 2048 --repeats 3 --decode-steps 16 \
  --no-progress --out "$RES/models-cuda.json"
# streaming ASR at the released shape (its 2.5 GB random checkpoint made here, ~10 s), lookahead 6
# only, one timed round: RTF against transformers' streaming generate on the same weights, the
# endpoint fork against waiting out the lookahead, capsule copies. 30 s taken from the caps above
# (ckpt 7, ttft 12, capsules 6, models 6); the JSON is written after each section
step 2 27 "asr nemotron real on cuda: RTF vs transformers at lookahead 6, endpoint fork" "$PY" \
  bench/asr.py --device cuda --lookaheads 6 --repeats 1 --no-progress --out "$RES/asr-cuda.json"
# Pocket TTS at the released shape (its 0.45 GB random checkpoint made here, a few seconds), one
# timed round, short runs (8 frames streamed; 5 of 10 played at the barge-in): time to first audio
# (WAV, latents, voice capsule), RTF against transformers, rollback. 27 s taken from the caps
# above (ckpt 5, ttft 12, capsules 3, models 4, asr 3); the JSON is written after each section
step 2 24 "tts pocket_tts real on cuda: TTFA from a voice capsule, RTF vs transformers" "$PY" \
  bench/tts.py --device cuda --frames 8 --made 10 --played 5 --repeats 1 --warmup 0 --no-progress \
  --out "$RES/tts-cuda.json"

echo; echo "=== done in $(now)s ==="
publish
# exit status: 0 only when every step ran and passed (a plan counts as passing)
"$PY" -c "import json, sys; s = json.load(open('$RES/gpu_check-summary.json')); \
bad = [n for n, st in ((x['name'], x['status']) for x in s['steps']) if st not in ('ok', 'planned')]; \
print(len(s['steps']) - len(bad), 'steps ok or planned; not ok:', bad or 'none'); sys.exit(1 if bad else 0)"
