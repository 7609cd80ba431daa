#!/usr/bin/env bash
# Remove what deploy/local/up.sh made: its pods, their volumes, the network and the secrets (the
# run directory). The images stay (podman rmi localhost/bear:latest localhost/bear-base:bookworm).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
RUN=${BEAR_DEPLOY_RUN:-$HERE/run}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
command -v podman >/dev/null || { echo "error: podman not found" >&2; exit 1; }
[ -d "$RUN" ] || { echo "nothing to remove: no $RUN"; exit 0; }
if [ -f "$RUN/play.yaml" ]; then podman kube down "$RUN/play.yaml" >/dev/null 2>&1 || true; fi
if [ -f "$RUN/pods" ]; then
  while read -r pod; do podman pod rm -f -t 5 "$pod" >/dev/null 2>&1 || true; done <"$RUN/pods"
fi
if [ -f "$RUN/volumes" ]; then
  while read -r vol; do podman volume rm -f "$vol" >/dev/null 2>&1 || true; done <"$RUN/volumes"
fi
if [ -f "$RUN/network" ]; then podman network rm -f "$(cat "$RUN/network")" >/dev/null 2>&1 || true; fi
left=""
if [ -f "$RUN/pods" ]; then
  while read -r pod; do podman pod exists "$pod" && left+=" pod:$pod"; done <"$RUN/pods"
fi
if [ -f "$RUN/volumes" ]; then
  while read -r vol; do podman volume exists "$vol" && left+=" volume:$vol"; done <"$RUN/volumes"
fi
if [ -f "$RUN/network" ] && podman network exists "$(cat "$RUN/network")"; then left+=" network:$(cat "$RUN/network")"; fi
[ -z "$left" ] || { echo "error: could not remove:$left" >&2; exit 1; }
rm -rf "$RUN"
echo "removed every pod, volume, network and secret of the deployment"
