#!/usr/bin/env bash
# The main job, from a fresh clone: create .venv, install slime_tis with the example extras, train
# algorithm 0 (standard PPO) and algorithm 2 (decoupled PPO, geometric-mean masking) for 50 steps each under the
# same seed and the same mismatch (bf16 rollout engine, rollouts 2 steps stale), print the comparison
# table and write runs/quickstart/compare.png. The two runs go in parallel (JOBS=2): under 5 minutes on 2 CPU cores
# (about 2 minutes on an idle machine, install included once the wheels are cached).
#
#   bash examples/quickstart.sh                  # defaults above
#   MISMATCH=bf16 ALGS="0 3" bash examples/quickstart.sh     (variants: python -m examples.compare --help)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ALGS=${ALGS:-"0 2-geo-mis"}
MISMATCH=${MISMATCH:-lag2}
STEPS=${STEPS:-50}
OUT=${OUT:-runs/quickstart}
JOBS=${JOBS:-2}

if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv"
    "$PYTHON" -m venv .venv
fi
echo "== installing slime_tis[example] (torch and megatron-core pinned by constraints.txt)"
.venv/bin/python -m pip install -q -c constraints.txt -e '.[example]'

echo "== training: algorithms ${ALGS} under mismatch '${MISMATCH}', ${STEPS} steps each"
# shellcheck disable=SC2086
.venv/bin/python -m examples.compare --algs ${ALGS} --mismatch "${MISMATCH}" --steps "${STEPS}" \
    --jobs "${JOBS}" --out-dir "${OUT}" --plot
echo "== curves: ${OUT}/compare.png   logs: ${OUT}/*/metrics.jsonl   TensorBoard: .venv/bin/tensorboard --logdir ${OUT}"
