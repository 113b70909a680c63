#!/usr/bin/env bash
# GPU acceptance of slime_tis: one command for a lent H100 / H200, in one device call (8 minutes on an H100).
#
#   bash benchmarks/gpu_wheels.sh                     # first, here (network): builds .whl/, the carried wheels
#   bash benchmarks/gpu_acceptance.sh                 # CUDA: the carried set, correctness, then the timings; in $OUT
#   bash benchmarks/gpu_acceptance.sh --out DIR       # results in DIR (default: $OUT, else gpu_acceptance_out)
#   bash benchmarks/gpu_acceptance.sh --cpu-smoke     # no GPU: every step's code on tiny shapes, CPU stand-ins
#   bash benchmarks/gpu_acceptance.sh --help
#
# Before any timed step (CUDA): .whl/*.whl is installed into /tmp/site (pip --no-index --no-deps) and every
# carried library must import (benchmarks/_third_party.py: megatron-core, liger-kernel, cut-cross-entropy, verl
# and the pure-Python packages verl uses); otherwise the run stops with exit 3 naming what is missing.
# Steps (each under its own time limit; the limits add up to at most the budget; a failing step does not stop
# the others):
#   1. carried_set: the libraries import, with their versions;
#   2. correctness (gpu_acceptance.py): log-prob kernels at 16384 x 151936 bf16 (T x V > 2^31) with NaN, +-inf
#      and masked rows, the fused output layer and the fp32 LM head, against the torch path and float64;
#   3. core_no_host_sync (gpu_check_core.py): the correction core without host sync, its Triton token pass = torch;
#   4. logprob_kernels (bench_logprobs_kernel.py): log-probs + entropy fwd+bwd at 16k x 32k and 16k x 152k bf16,
#      all and half the rows: plain torch (log_softmax + gather), this package's torch path and Triton kernel,
#      verl, Liger, (verl's fused kernel and Cut Cross-Entropy take hidden states: step 5); time, x HBM floor, memory;
#   5. output_layer (bench_output_layer.py): hidden [16k, 4096] -> log-probs, V = 152064: unfused, fused, fp32 LM
#      head (new and upcast), verl's fused kernel, Liger, Cut Cross-Entropy;
#   6. megatron_step (bench_megatron_step.py): the hook's step on a bf16 megatron-core GPT vs plain PPO;
#   7. loss_hook_1m_tokens (gpu_check_megatron.py): the loss hook alone vs plain PPO, 1M tokens, no host sync;
#   8. correction_vs_verl (bench_correction.py): the core correction vs verl's helper, 1M-token batches.
# Every step runs with a kernel fallback to torch as an error (KernelFallbackWarning).
# Written: DIR/summary.md and DIR/summary.json (one table of every step, then each step's side-by-side table),
# DIR/gpu_acceptance.md (the summary and every step's output), DIR/<step>.json.
# Exit status: 3 if the carried set is incomplete (CUDA), 1 if a checking step failed (1-4, 6, 7) or the summary
# misses a step, a method or a column, 2 without CUDA (unless --cpu-smoke), else 0; speed targets are reported.
#
# The carried wheels: `bash benchmarks/gpu_wheels.sh` runs, in the repo root,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 ... --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1 \
#     liger-kernel==0.8.5 cut-cross-entropy==25.1.1 verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 \
#     codetiming==1.4.0
# and checks the folder (about 6 MiB); the device call names .whl in `carry` (docs/kernels.md has the command).
set -u -o pipefail

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

SMOKE=0
DIR="${OUT:-gpu_acceptance_out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --help|-h) usage; exit 0 ;;
    --cpu-smoke) SMOKE=1 ;;
    --out) shift; DIR="${1:?--out needs a directory}" ;;
    *) echo "gpu_acceptance.sh: unknown argument: $1 (see --help)" >&2; exit 64 ;;
  esac
  shift
done

cd "$(dirname "$0")/.." || exit 64
mkdir -p "$DIR" || exit 64
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" VERL_LIGHT_FORCE=1
REPORT="$DIR/gpu_acceptance.md"
: > "$REPORT"
: > "$DIR/steps.tsv"
FAILED=()

if [ "$SMOKE" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_acceptance.sh: CUDA is not available: nothing measured (--cpu-smoke runs the code on tiny shapes)" \
    | tee -a "$REPORT"
  exit 2
fi

# The carried set, before anything is timed (CUDA): the wheels install, and the first step (every library
# imports) ends the run with exit 3 when one does not.
if [ "$SMOKE" = 0 ]; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "CARRIED SET INCOMPLETE: no .whl/*.whl (run bash benchmarks/gpu_wheels.sh here, name .whl in carry)" \
      | tee -a "$REPORT"
    exit 3
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tee -a "$REPORT"
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

# The whole run ends inside one device call: 8 minutes on an H100. Each step's limit is its share of the budget,
# and the limits add up to at most the budget less the install and the summary (checked here).
BUDGET_S="${GPU_ACCEPTANCE_BUDGET_S:-480}"
LIMITS=(carried_set=20 correctness=90 core_no_host_sync=40 logprob_kernels=100 output_layer=80 megatron_step=60
        loss_hook_1m_tokens=30 correction_vs_verl=25)
SUM=0; for kv in "${LIMITS[@]}"; do SUM=$((SUM + ${kv#*=})); done
if [ $((SUM + 30)) -gt "$BUDGET_S" ]; then
  echo "gpu_acceptance.sh: the step limits add up to $SUM s, over the budget $BUDGET_S s less 30 s" >&2; exit 64
fi
# The CPU smoke run (a shared CI machine, the Triton interpreter) gets 4x every limit and 4x the budget.
SCALE=1; if [ "$SMOKE" = 1 ]; then SCALE=4; BUDGET_S=$((BUDGET_S * SCALE)); fi
limit_of() { local kv; for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$1" ] && echo $((${kv#*=} * SCALE)); done; }

# step NAME CHECKING(0/1) COMMAND...: run under its limit, output to the terminal and the report, a line in steps.tsv
step() {
  local name="$1" checking="$2"; shift 2
  local limit left rc t0=$SECONDS
  limit=$(limit_of "$name")
  left=$((BUDGET_S - SECONDS - 10))
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  if [ "$limit" -lt 5 ]; then
    echo "## $name: SKIPPED, the time budget ($BUDGET_S s) is spent" | tee -a "$REPORT"
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 >> "$DIR/steps.tsv"
    FAILED+=("$name (not run: time budget)")
    return
  fi
  echo "## $name" | tee -a "$REPORT"
  echo '```' >> "$REPORT"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$REPORT"
  rc=${PIPESTATUS[0]}
  echo '```' >> "$REPORT"
  echo "($name: exit $rc, $((SECONDS - t0)) s of $limit)" | tee -a "$REPORT"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >> "$DIR/steps.tsv"
  if [ "$rc" != 0 ] && [ "$checking" = 1 ]; then FAILED+=("$name (exit $rc)"); fi
  if [ "$rc" != 0 ] && [ "$checking" = 0 ]; then echo "note: $name exited $rc" | tee -a "$REPORT"; fi
}

{
  echo "# GPU acceptance: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import sys, torch, triton; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, cuda \
{torch.version.cuda}, triton {triton.__version__}, device \
{torch.cuda.get_device_name() if torch.cuda.is_available() else \"none (cpu smoke run)\"}')"
  echo '```'
} 2>&1 | tee -a "$REPORT"

J="$DIR"
if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1  # the Triton kernels on CPU tensors
  step carried_set 1 "$PY" benchmarks/_third_party.py --check-imports --stand-ins-ok --json "$J/carried_set.json"
  step correctness 1 "$PY" benchmarks/gpu_acceptance.py --device cpu --tiny --json "$J/correctness.json"
  step core_no_host_sync 1 "$PY" benchmarks/gpu_check_core.py --device cpu --json "$J/core.json"
  step logprob_kernels 1 "$PY" benchmarks/bench_logprobs_kernel.py --cpu-smoke --json "$J/logprob_kernel.json"
  step output_layer 0 "$PY" benchmarks/bench_output_layer.py --cpu-smoke --json "$J/output_layer.json"
  step megatron_step 1 "$PY" benchmarks/bench_megatron_step.py --device cpu --tiny --json "$J/megatron_step.json"
  step loss_hook_1m_tokens 1 "$PY" benchmarks/gpu_check_megatron.py --device cpu --tokens 4096 --micro-tokens 2048 \
    --seq-len 512 --vocab 512 --json "$J/loss_hook.json"
  step correction_vs_verl 0 "$PY" benchmarks/bench_correction.py --cpu-smoke --json "$J/correction.json"
else
  step carried_set 1 "$PY" benchmarks/_third_party.py --check-imports --json "$J/carried_set.json"
  if [ ${#FAILED[@]} -gt 0 ]; then exit 3; fi  # nothing is timed without the whole carried set (named above)
  step correctness 1 "$PY" benchmarks/gpu_acceptance.py --json "$J/correctness.json"
  step core_no_host_sync 1 "$PY" benchmarks/gpu_check_core.py --json "$J/core.json"
  step logprob_kernels 1 "$PY" benchmarks/bench_logprobs_kernel.py --repeats 10 --json "$J/logprob_kernel.json"
  step output_layer 0 "$PY" benchmarks/bench_output_layer.py --iters 3 --warmup 1 --json "$J/output_layer.json"
  step megatron_step 1 "$PY" benchmarks/bench_megatron_step.py --warmup 1 --steps 3 --json "$J/megatron_step.json"
  step loss_hook_1m_tokens 1 "$PY" benchmarks/gpu_check_megatron.py --json "$J/loss_hook.json"
  step correction_vs_verl 0 "$PY" benchmarks/bench_correction.py --device cuda --repeats 5 --json "$J/correction.json"
fi

echo "## summary" | tee -a "$REPORT"
if ! "$PY" benchmarks/gpu_acceptance.py --summary "$DIR" 2>&1 | tee -a "$REPORT"; then
  FAILED+=("summary (a step, a method or a column is missing)")
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED: ${FAILED[*]}" | tee -a "$REPORT"
  exit 1
fi
echo "all checks passed; the tables above hold the timings (summary.md, summary.json)" | tee -a "$REPORT"
exit 0
