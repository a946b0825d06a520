#!/usr/bin/env bash
# Install real SGLang 0.5.23 into its own venv (it pins its own torch, so it cannot share .venv).
# ~11 GB (SGLang pulls torch 2.14 with CUDA libraries even for CPU use); uv makes it a few
# minutes instead of ~15. Idempotent: does nothing when the venv already has SGLang 0.5.23.
# The venv: $RLACTORS_SGLANG_VENV, default ~/.cache/rlactors/sglang-0.5.23. Prints its python.
set -euo pipefail
VERSION=0.5.23
VENV=${RLACTORS_SGLANG_VENV:-$HOME/.cache/rlactors/sglang-$VERSION}
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "
import importlib.metadata as m, sys
sys.exit(m.version('sglang') != '$VERSION')" 2>/dev/null; then
  echo "[sglang-setup] ready: $VENV (sglang $VERSION)" >&2
  echo "$VENV/bin/python"
  exit 0
fi
echo "[sglang-setup] installing sglang==$VERSION into $VENV (~11 GB, a few minutes)" >&2
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q uv >&2
start=$(date +%s)
"$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" "sglang==$VERSION" >&2
echo "[sglang-setup] installed in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
