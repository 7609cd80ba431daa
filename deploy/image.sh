#!/usr/bin/env bash
# Build BEAR's one image (deploy/Dockerfile) as $BEAR_IMAGE (default localhost/bear:latest) on
# $BEAR_BASE_IMAGE (default docker.io/library/python:3.11-slim; deploy/local/base-image.sh makes
# localhost/bear-base:bookworm where no registry is reachable). The wheels are made here first, by
# $PYTHON (CPython 3.11): the package with its C++ core and every dependency, from this host's
# package index; the container build then needs no network and no compiler. podman, else docker.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
IMAGE=${BEAR_IMAGE:-localhost/bear:latest}
BASE=${BEAR_BASE_IMAGE:-docker.io/library/python:3.11-slim}
PY=${PYTHON:-python3}
ENGINE=${BEAR_CONTAINER_ENGINE:-$(command -v podman || command -v docker || true)}
[ -n "$ENGINE" ] || { echo "error: neither podman nor docker found: install one (apt-get install podman runc)" >&2; exit 1; }
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  echo "error: $PY is not CPython 3.11, the image's Python: set PYTHON to a python3.11" >&2
  exit 1
fi
ctx=${BEAR_IMAGE_CONTEXT:-$ROOT/deploy/build}
rm -rf "$ctx/wheels" && mkdir -p "$ctx/wheels"
start=$(date +%s)
if ! "$PY" -m pip wheel --quiet --disable-pip-version-check "$ROOT" -w "$ctx/wheels" >"$ctx/wheels.log" 2>&1; then
  grep -v '^WARNING: Location' "$ctx/wheels.log" | tail -n 20 >&2
  echo "error: building the wheels failed (log: $ctx/wheels.log): a compiler and cmake are needed for libbea" >&2
  exit 1
fi
if ! "$ENGINE" build --quiet -f "$ROOT/deploy/Dockerfile" --build-arg BASE_IMAGE="$BASE" -t "$IMAGE" "$ctx" \
    >"$ctx/build.log" 2>&1; then
  tail -n 20 "$ctx/build.log" >&2
  echo "error: the image build failed (log: $ctx/build.log); base image $BASE" >&2
  exit 1
fi
echo "image $IMAGE built on $BASE in $(( $(date +%s) - start )) s"
