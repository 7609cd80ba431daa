#!/usr/bin/env bash
# Make the base image BEAR's image builds on, without an image registry: a minimal Debian bookworm
# root file system (mmdebstrap) with Python 3.11 and the one C library LightGBM needs at run time
# (libgomp1), imported into podman as $BEAR_BASE_IMAGE (default localhost/bear-base:bookworm).
# Idempotent: an image already there is kept (BEAR_REBUILD_BASE=1 makes it again). About 1 min.
set -euo pipefail
IMAGE=${BEAR_BASE_IMAGE:-localhost/bear-base:bookworm}
HERE="$(cd "$(dirname "$0")" && pwd)"
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
if podman image exists "$IMAGE" && [ "${BEAR_REBUILD_BASE:-0}" != "1" ]; then
  echo "base image $IMAGE already there"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "error: mmdebstrap not found: apt-get install mmdebstrap" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
if ! mmdebstrap --quiet --variant=apt --include=python3,python3-venv,ca-certificates,libgomp1 bookworm \
    "$work/rootfs.tar" >"$work/log" 2>&1; then
  tail -n 20 "$work/log" >&2
  echo "error: mmdebstrap could not make the bookworm root file system (is deb.debian.org reachable?)" >&2
  exit 1
fi
podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
  "$work/rootfs.tar" "$IMAGE" >/dev/null
echo "base image $IMAGE made in $(( $(date +%s) - start )) s"
