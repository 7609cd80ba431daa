#!/usr/bin/env bash
# mypy --strict on bear.protocol, bear.router and bear.estimator ([tool.mypy] in pyproject.toml).
# The import package bear is laid out from services/ by the build (pyproject.toml's
# wheel.packages), and the editable install finds it with an import hook mypy cannot follow: so
# mypy reads a copy of that layout made of symbolic links, in a temporary directory.
#   .ci/typecheck.sh [MYPY]      (default: .venv/bin/mypy)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MYPY=${1:-$ROOT/.venv/bin/mypy}
MYPY="$(cd "$(dirname "$MYPY")" && pwd)/$(basename "$MYPY")"  # absolute: it runs from the temporary tree
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/bear"
for d in "$ROOT"/services/*/; do
  name=$(basename "$d")
  [ "$name" = bear ] || ln -s "$d" "$tree/bear/$name"
done
cp "$ROOT"/services/bear/*.py "$ROOT"/services/bear/*.pyi "$tree/bear/"
cd "$tree"
"$MYPY" --config-file "$ROOT/pyproject.toml" -p bear.protocol -p bear.router -p bear.estimator
