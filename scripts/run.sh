#!/usr/bin/env bash
# Install (if needed) and run the main job: asynchronous GRPO on GSM8K.
# Arguments go to the recipe, e.g. `bash scripts/run.sh trainer.lr=1e-5` or `--config recipes/configs/gpu.toml`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python recipes/gsm8k_grpo.py "$@"
