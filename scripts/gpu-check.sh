#!/usr/bin/env bash
# The GPU paths in one command, on a machine with a GPU and torch but no network:
#   bash scripts/gpu-wheelhouse.sh            # here, with network: builds .gpu-check/ (<= 60 MiB)
#   bash scripts/gpu-check.sh                 # there, from the repository's root
# It installs rlactors and its packages from the wheelhouse into a scratch folder (no index, no
# editable install: the check runs the installed package, from outside this tree), then runs
# scripts/gpu_check.py: FSDP2 in bf16 on CUDA, weight pushes to the reference server on the same
# GPU (through a weight-update group, and by reference), and the recipe with the one-GPU config's
# geometry (recipes/configs/gpu_1x.toml: trainer and server sharing the GPU, tensor push) and the
# tiny model for 3 steps. One JSON report (--report, default gpu-check-report.json) holds each
# step's result and timing; the exit code is the number of failed steps. Its scratch folder is
# removed at exit, but for the steps' logs when one failed.
# --device cpu runs the same steps on CPU (gloo; bf16 where the CPU has it); CI runs it so, with a
# wheelhouse for its own Python (--python-version of gpu-wheelhouse.sh).
#   bash scripts/gpu-check.sh [--device cuda|cpu] [--wheelhouse DIR] [--python PY] [--steps N] [--report FILE]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEVICE=cuda
WH=$ROOT/.gpu-check
PY=python3
STEPS=3
REPORT=$PWD/gpu-check-report.json
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --wheelhouse) WH=$(cd "$2" && pwd); shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --report) REPORT=$(realpath -m "$2"); shift 2 ;;
    *) echo "usage: $0 [--device cuda|cpu] [--wheelhouse DIR] [--python PY] [--steps N] [--report FILE]" >&2; exit 2 ;;
  esac
done
[ -d "$WH/wheels" ] || { echo "no wheelhouse at $WH: run scripts/gpu-wheelhouse.sh first (with network)" >&2; exit 2; }
PY=$(realpath -s "$(command -v "$PY")")  # absolute, the venv kept (no symlink resolved)
WORK=$(mktemp -d -t rlactors-gpu-check-XXXXXX)
# the installed packages and the model cache go at exit (~240 MiB); the steps' logs stay if a step failed
failed=1
trap 'rm -rf "$WORK/site" "$WORK/cache"; [ "$failed" != 0 ] || rm -rf "$WORK"' EXIT
mkdir -p "$(dirname "$REPORT")"
t0=$(date +%s)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WH"/wheels/*.whl
echo "[gpu-check] installed $(ls "$WH"/wheels | wc -l) wheels into $WORK/site in $(( $(date +%s) - t0 )) s"
mkdir -p "$WORK/cache"
cp -r "$WH/cache/." "$WORK/cache/"
# only the installed packages: the tree's own folders are not on the path (cwd is the scratch folder)
export PYTHONPATH=$WORK/site RLACTORS_CACHE=$WORK/cache PYTHONUNBUFFERED=1
cd "$WORK"
set +e
"$PY" "$ROOT/scripts/gpu_check.py" --device "$DEVICE" --steps "$STEPS" --config "$ROOT/recipes/configs/gpu_1x.toml" \
  --work "$WORK/work" --report "$REPORT"
failed=$?
set -e
if [ "$failed" = 0 ]; then
  echo "[gpu-check] report: $REPORT (0 failed)"
else
  echo "[gpu-check] report: $REPORT ($failed failed); logs: $WORK/work"
fi
exit $failed
