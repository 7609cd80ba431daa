#!/usr/bin/env bash
# One vLLM instance with BEAR's scheduler plugin, and the snapshotter beside it.
#   INSTANCE=qwen8b-0 MODEL=Qwen/Qwen3-8B PORT=8000 NATS=nats://nats:4222 \
#   VLLM_API_KEY=<this engine's key> BEAR_NATS_CREDS=auth/instance-qwen8b-0.json deploy/vllm/launch.sh
# The engine requires VLLM_API_KEY on every /v1 request (the routers hold it: --engine-keys); the
# snapshotter connects as the instance's own NATS identity (docs/security.md).
# The plugin needs only vLLM + the standard library: put services/snapshotter on PYTHONPATH of the
# vLLM environment (or install bear there). Pinned vLLM versions: see docs/snapshotter.md.
set -euo pipefail
: "${INSTANCE:?}" "${MODEL:?}" "${PORT:=8000}" "${NATS:=nats://127.0.0.1:4222}"
: "${VLLM_API_KEY:?set the engine's API key (vLLM refuses requests without it)}"
: "${BEAR_NATS_CREDS:?set the instance's NATS identity file (bear nats config)}"
export VLLM_API_KEY BEAR_NATS_CREDS
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHONPATH="$HERE/services/snapshotter${PYTHONPATH:+:$PYTHONPATH}" BEAR_SNAPSHOT_SHM="$INSTANCE" \
  python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT" \
  --scheduler-cls bear_vllm_plugin.make_scheduler "$@" &
VLLM_PID=$!
trap 'kill $VLLM_PID 2>/dev/null; wait' EXIT INT TERM
bear snapshotter --instance "$INSTANCE" --shm "$INSTANCE" --nats "$NATS" --model "$MODEL" \
  --base-url "http://$(hostname -i 2>/dev/null | cut -d' ' -f1 || echo 127.0.0.1):$PORT/v1" --log-format json
