#!/usr/bin/env bash
# Install (if needed) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The tree's bytecode, written once: the suite starts about a thousand Python processes, and where
# PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines) each would compile every module
# of ours it imports again (installed packages were compiled by pip).
.venv/bin/python -m compileall -q -j 0 rlactors nodes protocols recipes tests bench scripts examples
exec .venv/bin/python -m pytest "$@"
