#!/usr/bin/env bash
# The main job, from a fresh clone: create .venv, install slime_tis with the example extras, and train the example
# policy under stale rollouts (the engine samples with the policy of two rollouts ago, bf16 engine,
# --rollout-lag 2, at --lr 1e-2 with 4 optimizer steps per rollout: --steps-per-rollout 2 --ppo-epochs 2), with
# the correction off and on: algorithm 0 (PPO, no correction), algorithm 2 (decoupled PPO, token truncation at 2,
# --use-tis) and algorithm 2 with the searched bound (--tis-upper-bound auto --tis-target-ess 0.9). Seeds 22 and
# 23, 40 steps each: the setting of docs/results.md's "Stale rollouts" table, where uncorrected PPO's grad norm
# explodes. Prints the comparison table and, per seed, each run's final reward, largest grad norm and mean
# tis/k3_kl; writes runs/quickstart/compare.png (seed 22) and bands.png (both seeds); its last line is the
# diagnose command for algorithm 0's log-prob dump, runnable as printed.
# Six runs, two at a time (JOBS=2): 96-138 s of training on a 2-core machine shared with other jobs, plus the
# install. Two seeds are a demonstration, not a statistic: docs/results.md has the 5-seed table.
#
#   bash examples/quickstart.sh                                   # defaults above
#   MISMATCH="moe moe-replay" ALGS=2 SEEDS="0 1 2" STEPS=30 LR=3e-3 bash examples/quickstart.sh   # MoE routing replay
#   SKIP_INSTALL=1 VENV_PY=/path/to/python bash examples/quickstart.sh    # an existing environment, no install
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ALGS=${ALGS:-"0 2 2-auto"}
MISMATCH=${MISMATCH:-"lag2"}
SEEDS=${SEEDS:-"22 23"}
STEPS=${STEPS:-40}
LR=${LR:-1e-2}
TRAIN_ARGS=${TRAIN_ARGS:-"--steps-per-rollout 2 --ppo-epochs 2 --lr ${LR}"}
OUT=${OUT:-runs/quickstart}
JOBS=${JOBS:-2}
VENV_PY=${VENV_PY:-.venv/bin/python}

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    if [ ! -x .venv/bin/python ]; then
        echo "== creating .venv"
        "$PYTHON" -m venv .venv
    fi
    echo "== installing slime_tis[example] (torch and megatron-core pinned by constraints.txt)"
    .venv/bin/python -m pip install -q -c constraints.txt -e '.[example]'
fi

echo "== training: algorithms ${ALGS} under '${MISMATCH}', seeds ${SEEDS}, ${STEPS} steps each (${TRAIN_ARGS})"
# shellcheck disable=SC2086
"$VENV_PY" -m examples.compare --algs ${ALGS} --mismatch ${MISMATCH} --seeds ${SEEDS} --steps "${STEPS}" \
    --jobs "${JOBS}" --out-dir "${OUT}" --plot -- ${TRAIN_ARGS}
# shellcheck disable=SC2086
"$VENV_PY" -m examples.compare --headline --algs ${ALGS} --mismatch ${MISMATCH} --seeds ${SEEDS} --out-dir "${OUT}"
BIN=$(dirname "$VENV_PY")
read -r FIRST_MM _ <<< "${MISMATCH}"
read -r FIRST_ALG _ <<< "${ALGS}"
read -r FIRST_SEED _ <<< "${SEEDS}"
echo "== curves: ${OUT}/compare.png ${OUT}/bands.png   logs: ${OUT}/*/metrics.jsonl   TensorBoard: ${BIN}/tensorboard --logdir ${OUT}"
echo "== log-prob dumps: ${OUT}/*/logprobs.jsonl; what the mismatch of one run is and which correction fits it:"
echo "${BIN}/slime-tis diagnose ${OUT}/${FIRST_MM}-alg${FIRST_ALG}-s${FIRST_SEED}"
