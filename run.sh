#!/usr/bin/env bash
# FlashRT set-up and entry points. Usage:
#   ./run.sh demo    set up (first time), then run the demo on the embedded default model
#   ./run.sh test    set up (first time), then run the whole test suite
#   ./run.sh setup   only set up
# Set-up makes .venv (seeing system site-packages, so an installed torch is reused), installs
# torch only when none is importable (the CPU wheel torch==2.13.0 when no GPU is present),
# then builds and installs flashrt with its C++ extension.
set -euo pipefail
cd "$(dirname "$0")"
VENV="$PWD/.venv"
PY="$VENV/bin/python"

setup() {
  [ -x "$PY" ] || python3 -m venv --system-site-packages "$VENV"
  if ! "$PY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "$PY" -m pip install -q torch
    else
      "$PY" -m pip install -q torch==2.13.0
    fi
  fi
  "$PY" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" ninja \
      "safetensors>=0.4" "numpy>=1.24" "transformers>=4.57" pytest "hypothesis>=6.100" matplotlib tqdm "redis>=5"
  # Triton: CUDA torch wheels bring their own; elsewhere the pinned release whose CPU interpreter
  # the kernel tests use (a platform without a wheel only skips those tests).
  if ! "$PY" -c "import triton" 2>/dev/null; then
    "$PY" -m pip install -q "triton==3.9.0" || echo "triton unavailable: its kernel tests will skip"
  fi
  # the serve extra (flashrt serve and tests/test_serve.py)
  "$PY" -m pip install -q "fastapi>=0.110" "uvicorn>=0.29" "jinja2>=3.1" "tokenizers>=0.19" \
      "openai>=1.30" "httpx>=0.27" "python-multipart>=0.0.9" "websockets>=12"
  # the agents extra: xgrammar for constrained decoding (flashrt/lm/grammar.py); the torch and
  # triton above satisfy its requirements, so neither is replaced
  "$PY" -m pip install -q "xgrammar==0.2.9"
  # the agent-clients extra: LangChain, LangGraph, the OpenAI Agents SDK, pydantic-ai and litellm,
  # which tests/test_agent_clients.py runs against flashrt serve; where they do not install, it skips
  "$PY" -m pip install -q "langchain-openai==1.8.1" "langgraph==1.2.24" "openai-agents==0.24.0" \
      "pydantic-ai-slim[openai]==2.68.0" "litellm==1.110.2" \
      || echo "run.sh: the agent-clients extra did not install: tests/test_agent_clients.py will skip" >&2
  # the speech extra (flashrt.speech): Silero VAD's wheel ships its real weights, which the
  # speech tests run (tests/test_speech_vad.py skips without it)
  "$PY" -m pip install -q "silero-vad>=6"
  # the voice-clients extra: Pipecat, whose OpenAI services tests/test_pipecat.py runs against
  # flashrt serve (Python >= 3.11); where it does not install, that test skips
  "$PY" -m pip install -q "pipecat-ai[openai]==1.14.0" \
      || echo "run.sh: pipecat-ai did not install: tests/test_pipecat.py will skip" >&2
  # the shared capsule tier's tests start a real redis-server (Debian's) on loopback, with TLS
  # certificates made by openssl
  local missing=""
  command -v redis-server >/dev/null 2>&1 || missing="redis-server"
  command -v openssl >/dev/null 2>&1 || missing="$missing openssl"
  if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
    else
      echo "run.sh: missing $missing (apt-get install as root); the Redis tier tests will fail" >&2
    fi
  fi
  # --no-deps: never let pip swap the torch that is already there.
  "$PY" -m pip install -q --no-build-isolation --no-deps .
  # from tests/, so the installed package is imported rather than the source tree
  (cd tests && "$PY" -c "import flashrt.native as n; print('flashrt extension:', n.ext_status())")
}

case "${1:-demo}" in
  setup) setup ;;
  demo)  setup; "$VENV/bin/flashrt" demo "${@:2}" ;;
  # Run from tests/ so the installed package (extension included) is imported, not the
  # source tree that `python -m` would put first on sys.path.
  test)  setup; cd tests && "$PY" -m pytest -q . "${@:2}" ;;
  *) echo "usage: ./run.sh demo|test|setup" >&2; exit 2 ;;
esac
