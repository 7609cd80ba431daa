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
if [ -x .ci/install-vllm.sh ] && [ "${BEAR_SKIP_VLLM:-0}" != "1" ]; then
  bash .ci/install-vllm.sh
  export BEAR_VLLM_PYTHON="${BEAR_VLLM_PYTHON:-$(cat .ci/.vllm-python 2>/dev/null || echo)}"
fi
"$VENV/bin/ruff" check services tests
"$VENV/bin/pytest" -q -m "not slow and not vllm" -p no:cacheprovider
"$VENV/bin/pytest" -q -m "slow or vllm" -p no:cacheprovider
