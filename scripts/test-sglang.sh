#!/usr/bin/env bash
# The SGLang-protocol conformance suite against a real SGLang server of its own on CPU, by hand:
# install SGLang 0.5.23 in its own venv if missing (scripts/sglang-setup.sh), start SGLang on the
# tiny model (its CPU engine; 1-4 min to start) and run the suite. CI runs the same files in the main
# suite instead (tests/sglang/test_conformance_sglang.py, against the real SGLang server that
# tests/sglang shares, so no start-up of its own), with the rest of tests/sglang (SGLang's own
# weight-sync code, the recipe with servers.kind = "sglang") whenever that venv exists.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
RLACTORS_CONFORMANCE_SGLANG=$(bash scripts/sglang-setup.sh)
export RLACTORS_CONFORMANCE_SGLANG
echo "[test-sglang] conformance suite against real SGLang ($RLACTORS_CONFORMANCE_SGLANG)"
exec .venv/bin/python -m pytest tests/conformance/test_generate.py tests/conformance/test_abort_pause.py \
  tests/conformance/test_update_mid_generation.py tests/conformance/test_weights.py \
  tests/conformance/test_validation.py tests/conformance/test_stream.py tests/conformance/test_logprobs.py \
  tests/conformance/test_penalties.py tests/conformance/test_openai_endpoint.py tests/conformance/test_auth.py "$@"
# tests/conformance/test_stream_incremental.py needs a second SGLang server (started with
# --incremental-streaming-output) beside this stage's: on a 2-core CI machine its start ran past
# the 300 s test timeout, so it is run by hand: RLACTORS_CONFORMANCE_SGLANG=<python> pytest <file>
