#!/usr/bin/env bash
# BEAR's cpu-sim deployment (deploy/k8s/overlays/cpu-sim) as podman pods on this host, from nothing:
# makes the base image if absent (deploy/local/base-image.sh), builds BEAR's image (deploy/image.sh),
# makes the secrets (deploy/make_secrets.py), renders the manifests (kubectl kustomize, else the
# committed deploy/k8s/rendered/cpu-sim.yaml), maps them to what podman plays (podman_play.py),
# plays them on the network $BEAR_NETWORK, waits until a query is routed end to end through the
# gateway, and prints the gateway's URL and key. deploy/local/down.sh removes all of it.
#   BEAR_GATEWAY_PORT  the gateway on 127.0.0.1 (default 18080)
#   BEAR_REPLICAS      pod counts, e.g. "estimator=3 router=2" (default: the manifests')
#   BEAR_REUSE_IMAGE=1 keep an existing $BEAR_IMAGE instead of building it again
#   BEAR_DEPLOY_RUN    where the state lives (default deploy/local/run)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
RUN=${BEAR_DEPLOY_RUN:-$HERE/run}
PORT=${BEAR_GATEWAY_PORT:-18080}
NETWORK=${BEAR_NETWORK:-bear}
export BEAR_IMAGE=${BEAR_IMAGE:-localhost/bear:latest}
export BEAR_BASE_IMAGE=${BEAR_BASE_IMAGE:-localhost/bear-base:bookworm}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
PY=${PYTHON:-python3}
fail() { echo "error: $*" >&2; exit 1; }
command -v podman >/dev/null || fail "podman not found: apt-get install podman runc mmdebstrap (deploy/README.md)"
[ ! -e "$RUN/play.yaml" ] || fail "a deployment is already up ($RUN): deploy/local/down.sh removes it"
start=$(date +%s)
if [ "$BEAR_BASE_IMAGE" = localhost/bear-base:bookworm ]; then bash "$HERE/base-image.sh"; fi
if [ "${BEAR_REUSE_IMAGE:-0}" = 1 ] && podman image exists "$BEAR_IMAGE"; then
  echo "image $BEAR_IMAGE kept (BEAR_REUSE_IMAGE=1)"
else
  bash "$ROOT/deploy/image.sh"
fi
mkdir -p "$RUN"
in_image() {  # python in BEAR's image, with deploy/ and the run directory mounted
  podman run --rm --user 0 --network none --entrypoint /opt/bear/bin/python \
    -v "$ROOT/deploy:/deploy:ro" -v "$RUN:/run/bear" "$BEAR_IMAGE" "$@"
}
if command -v kubectl >/dev/null; then
  kubectl kustomize "$ROOT/deploy/k8s/overlays/cpu-sim" >"$RUN/rendered.yaml"
else
  cp "$ROOT/deploy/k8s/rendered/cpu-sim.yaml" "$RUN/rendered.yaml"
fi
mapfile -t instances < <("$PY" -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))))' \
  "$ROOT/deploy/k8s/overlays/cpu-sim/instances.json")
in_image /deploy/make_secrets.py --out /run/bear/secrets "${instances[@]/#/--instance=}" >/dev/null
chown -R 10001:10001 "$RUN/secrets/files"   # the pods run as uid 10001; the files stay 0600
reps=()
for r in ${BEAR_REPLICAS:-}; do reps+=(--replicas "$r"); done
in_image /deploy/local/podman_play.py /run/bear/rendered.yaml --secrets /run/bear/secrets/files \
  --host-secrets "$RUN/secrets/files" --gateway-port "$PORT" --names /run/bear/pods --volumes /run/bear/volumes \
  "${reps[@]}" >"$RUN/play.yaml" 2>"$RUN/mapping.txt"
echo "$NETWORK" >"$RUN/network"
echo "http://127.0.0.1:$PORT/v1" >"$RUN/gateway"
podman network exists "$NETWORK" || podman network create "$NETWORK" >/dev/null
if ! podman kube play --network "$NETWORK" "$RUN/play.yaml" >"$RUN/play.log" 2>&1; then
  tail -n 5 "$RUN/play.log" >&2
  fail "podman kube play failed (log $RUN/play.log); deploy/local/down.sh cleans up"
fi
KEY_FILE="$RUN/secrets/files/bear-gateway-keys/keys"
if ! "$PY" "$HERE/wait_routed.py" "http://127.0.0.1:$PORT/v1" "$KEY_FILE" --timeout "${BEAR_UP_TIMEOUT:-300}"; then
  fail "no query was routed end to end in ${BEAR_UP_TIMEOUT:-300} s: podman logs router-0-router (pods: $RUN/pods)"
fi
echo "BEAR is up in $(( $(date +%s) - start )) s: $(wc -l <"$RUN/pods") pods on network $NETWORK"
echo "  gateway  http://127.0.0.1:$PORT/v1"
echo "  API key  $KEY_FILE"
echo "  stop     deploy/local/down.sh"
