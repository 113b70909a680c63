#!/usr/bin/env bash
# Results table of docs/example.md: algorithms 0-3 (+ 2 and 3 with geometric masking)
# x {no mismatch, bf16 decode, bf16 + rollout lag 2},
# 50 steps each, 3 seeds, single process on CPU. Prints the markdown table and writes
# runs/results/table.md and runs/results/compare.png. 54 runs of 10-40 s: about 10-35 min on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/results}
exec "$PY" -m examples.compare --algs 0 1 2 3 2-geo-mis 3-geo-mis --mismatch none bf16 lag2 --seeds 0 1 2 --steps 50 \
    --out-dir "$OUT" --plot "$@"
