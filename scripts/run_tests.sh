#!/usr/bin/env bash
# The test command of the README (and of .ci/run): create/refresh the virtualenv, install the
# package with its test extras, then lint and run every test (unit, verl oracle, distributed
# torchrun/gloo, end-to-end example job).
#
#   bash scripts/run_tests.sh            # everything
#   bash scripts/run_tests.sh -m "not dist and not slow"   # extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# constraints.txt pins torch==2.13.0 (the local CPU wheel; never the multi-GB CUDA build),
# megatron-core==0.16.1 and triton==3.6.0 (the Triton kernels' tests run on CPU under its interpreter,
# TRITON_INTERPRET=1, which they set themselves). setup.py itself only asks for ranges.
"$VENV/bin/pip" install -q -c constraints.txt -e '.[test]'
# verl 0.9.1 is a test oracle only: no deps (ray is stubbed in tests/_verl_light.py; transformers, pinned by
# constraints.txt to a version verl imports, comes with the test extras: the tests load the example's exported
# Hugging Face checkpoint with it).
"$VENV/bin/pip" install -q --no-deps verl==0.9.1
"$VENV/bin/pip" install -q -c constraints.txt tensordict omegaconf codetiming orjson

"$VENV/bin/ruff" check . tests/dist  # ruff skips directories named "dist" unless named explicitly
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m pytest -q --durations=15 "$@"
