#!/usr/bin/env bash
# Results table of docs/example.md: algorithms 0, 1, 2 (token truncation), 2 and 3 with geometric-mean masking,
# 2 with token masking (IcePop-style) x mismatch {none (fp32 engine), int8 engine, fp8 engine, bf16 + lag 2},
# SEEDS seeds (default 5), STEPS steps each. Prints the markdown table (final reward with 95% t intervals, the
# paired difference to algorithm 0 with its significance) and writes runs/results/table.md, compare.png and
# bands.png (per-step mean and 95% band over seeds).
#
#   bash examples/results_table.sh                                   # the grid above, one run at a time
#   JOBS=8 STEPS=150 bash examples/results_table.sh                  # 8 runs in parallel (many-core / GPU box)
#   bash examples/results_table.sh --algs 0 2 --mismatch int8        # extra args go to examples.compare ...
#   bash examples/results_table.sh -- --steps-per-rollout 4 --ppo-epochs 2   # ... and after `--` to every run
#
# Cost: 6 algorithms x 4 mismatches x 5 seeds = 120 runs; at the default model one step takes ~0.3-0.8 s on one
# CPU core (plus ~6 s start-up per run), so ~1-2.5 h at STEPS=100 with JOBS=1 on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/results}
STEPS=${STEPS:-100}
JOBS=${JOBS:-1}
SEEDS=${SEEDS:-"0 1 2 3 4"}
# shellcheck disable=SC2086
exec "$PY" -m examples.compare --algs 0 1 2 2-geo-mis 3-geo-mis 2-tok-mis --mismatch none int8 fp8 lag2 \
    --seeds ${SEEDS} --steps "$STEPS" --jobs "$JOBS" --out-dir "$OUT" --plot "$@"
