#!/usr/bin/env bash
# Results table of docs/example.md. Prints the markdown table (final reward with 95% t intervals, the paired
# difference to algorithm 0 with its significance) and writes OUT/table.md, compare.png and bands.png
# (per-step mean and 95% band over seeds).
#
# GRID=main (default): algorithms 0, 1, 2 (token truncation), 2 and 3 with geometric-mean masking, 2 with token
#   masking (IcePop-style) x mismatch {none (fp32 engine), int8 engine, fp8 engine, bf16 + lag 2} at the default
#   model (2 layers, hidden 64), SEEDS seeds (default 5), STEPS steps each (default 100).
#   Cost: 6 x 4 x 5 = 120 runs; one step ~0.3-0.8 s on one CPU core (plus ~6 s start-up per run), so ~1-2.5 h at
#   STEPS=100 with JOBS=1 on a 2-core machine.
# GRID=quant: where quantized rollouts start to matter (docs/example.md, "Where quantized rollouts start to
#   matter"): hidden size 256 (the smallest change found that makes fp8 rollouts' mismatch ~10x bf16's) and two
#   PPO epochs per rollout; algorithms 0, 2, 2 with geometric masking, 2 with token masking x mismatch
#   {bf16, int8, fp8 per channel, fp8 per tensor}, 5 seeds, STEPS (default 80).
#   Cost: 4 x 4 x 5 = 80 runs of 164-196 s each (measured: 80 steps, one thread, loaded 2-core machine), about
#   4 h with JOBS=1, about 2 h with JOBS=2 on an idle 2-core machine.
#
#   bash examples/results_table.sh                                   # the main grid, one run at a time
#   GRID=quant bash examples/results_table.sh                        # the quantized-rollout grid
#   JOBS=8 STEPS=150 bash examples/results_table.sh                  # 8 runs in parallel (many-core / GPU box)
#   bash examples/results_table.sh --algs 0 2 --mismatch int8        # extra args go to examples.compare ...
#   bash examples/results_table.sh -- --steps-per-rollout 4 --ppo-epochs 2   # ... and after `--` to every run
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
GRID=${GRID:-main}
JOBS=${JOBS:-1}
SEEDS=${SEEDS:-"0 1 2 3 4"}
case "$GRID" in
main)
    OUT=${OUT:-runs/results}
    STEPS=${STEPS:-100}
    PRESET=(--algs 0 1 2 2-geo-mis 3-geo-mis 2-tok-mis --mismatch none int8 fp8 lag2)
    ;;
quant)
    OUT=${OUT:-runs/results_quant}
    STEPS=${STEPS:-80}
    # one argument: argparse would read a separate "--hidden-size ..." value as an option
    PRESET=(--algs 0 2 2-geo-mis 2-tok-mis --mismatch bf16 int8 fp8 fp8-tensor
        "--train-args=--hidden-size 256 --ppo-epochs 2")
    ;;
*)
    echo "results_table.sh: GRID must be 'main' or 'quant', got '$GRID'" >&2
    exit 2
    ;;
esac
# shellcheck disable=SC2086
exec "$PY" -m examples.compare "${PRESET[@]}" --seeds ${SEEDS} --steps "$STEPS" --jobs "$JOBS" --out-dir "$OUT" \
    --plot "$@"
