#!/usr/bin/env bash
# One vLLM instance with BEAR's scheduler plugin, and the snapshotter beside it.
#   INSTANCE=qwen8b-0 MODEL=Qwen/Qwen3-8B PORT=8000 NATS=nats://nats:4222 deploy/vllm/launch.sh
# The plugin needs only vLLM + the standard library: put services/snapshotter on PYTHONPATH of the
# vLLM environment (or install bear there). Pinned vLLM versions: see docs/snapshotter.md.
set -euo pipefail
: "${INSTANCE:?}" "${MODEL:?}" "${PORT:=8000}" "${NATS:=nats://127.0.0.1:4222}"
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHONPATH="$HERE/services/snapshotter${PYTHONPATH:+:$PYTHONPATH}" BEAR_SNAPSHOT_SHM="$INSTANCE" \
  python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT" \
  --scheduler-cls bear_vllm_plugin.make_scheduler "$@" &
VLLM_PID=$!
trap 'kill $VLLM_PID 2>/dev/null; wait' EXIT INT TERM
bear snapshotter --instance "$INSTANCE" --shm "$INSTANCE" --nats "$NATS" --model "$MODEL" \
  --base-url "http://$(hostname -i 2>/dev/null | cut -d' ' -f1 || echo 127.0.0.1):$PORT/v1" --log-format json
