#!/usr/bin/env bash
# The whole test suite from a fresh checkout: create the environment, install everything
# (.ci/setup.sh), run ruff, lint-imports and mypy, the unit tests, then the multi-process / sanitizer / real-vLLM tests,
# each suite on $WORKERS pytest-xdist workers.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup.sh
"$VENV/bin/ruff" check services tests
"$VENV/bin/lint-imports"  # the layers of docs/architecture.md, no import cycles ([tool.importlinter] in pyproject.toml)
bash .ci/typecheck.sh "$VENV/bin/mypy"  # mypy --strict on bear.protocol, bear.router, bear.estimator
"$VENV/bin/pytest" -q -m "not slow and not vllm" -p no:cacheprovider -n "$WORKERS"
"$VENV/bin/pytest" -q -m "slow or vllm" -p no:cacheprovider -n "$WORKERS" --durations=15
