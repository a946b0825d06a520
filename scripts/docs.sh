#!/usr/bin/env bash
# Build the documentation site (mkdocs.yml, docs/) into build/site, strictly: a broken link or a
# missing page fails the build. Needs the `docs` extra (scripts/setup.sh installs it).
#   bash scripts/docs.sh            # strict build
#   bash scripts/docs.sh --check    # the same, and the generated reference pages must be current
#   bash scripts/docs.sh --serve    # preview at http://127.0.0.1:8000, rebuilt on every change
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export NO_MKDOCS_2_WARNING=1
case "${1:-}" in
  --serve) exec "$PY" -m mkdocs serve --dev-addr 127.0.0.1:8000 ;;
  --check)
    "$PY" scripts/gen-config-reference.py --check
    "$PY" scripts/gen-cli-reference.py --check
    "$PY" scripts/gen-metrics-reference.py --check
    "$PY" scripts/gen-page-regions.py --check
    ;;
  "") ;;
  *) echo "usage: bash scripts/docs.sh [--check | --serve]" >&2; exit 2 ;;
esac
exec "$PY" -m mkdocs build --strict
