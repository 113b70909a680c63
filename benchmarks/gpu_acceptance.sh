#!/usr/bin/env bash
# GPU acceptance of slime_tis: one command for a session with a lent H100 / H200, in one device call (< 10 min).
#
#   bash benchmarks/gpu_acceptance.sh                 # CUDA: correctness, then the timings; results in $OUT
#   bash benchmarks/gpu_acceptance.sh --out DIR       # results in DIR (default: $OUT, else gpu_acceptance_out)
#   bash benchmarks/gpu_acceptance.sh --cpu-smoke     # no GPU: every step's code on tiny shapes, nothing timed
#   bash benchmarks/gpu_acceptance.sh --help
#
# Steps (each under its own time limit; a step that fails does not stop the others):
#   1. correctness (benchmarks/gpu_acceptance.py): the log-prob kernels at 16384 x 151936 bf16 (T x V > 2^31)
#      with NaN, +-inf and masked rows, the fused output layer and the fp32 LM head, against the torch path and
#      float64, TP=1;
#   2. no host sync + the Triton token pass of the correction core (benchmarks/gpu_check_core.py);
#   3. log-prob kernels: speed beside the torch path and Liger-Kernel, x the HBM floor, peak memory
#      (benchmarks/bench_logprobs_kernel.py; it also compares triton with torch before timing);
#   4. output layer: fused vs unfused, Liger, Cut Cross-Entropy, fp32 LM head (new and upcast) (bench_output_layer.py);
#   5. the Megatron hook's step on a real bf16 megatron-core GPT vs a plain PPO loss (bench_megatron_step.py);
#   6. the loss hook alone on synthetic logits, 1M tokens, no host sync (gpu_check_megatron.py).
# Then a summary with the side-by-side ratio tables and the targets (log-prob fwd+bwd <= 1.3x the HBM floor at
# 16k x 152k; fused output layer <= 1.3x unfused with < 1 GiB extra; hook step <= 1.05x plain).
# Written: DIR/gpu_acceptance.md (summary + every step's output), DIR/correctness.json, DIR/output_layer.json,
# DIR/megatron_step.json, DIR/logprob_kernel.json. Exit status: 1 if a correctness step failed (1, 2, or 3's triton-vs-torch check),
# 2 without CUDA (unless --cpu-smoke), else 0; missed speed targets are reported, not failures.
#
# Optional packages the GPU image lacks travel as wheels (the device tool's README): in the repo root, here,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl megatron-core==0.16.1 liger-kernel==0.8.5
# (megatron-core is needed by step 5, liger-kernel only for its columns; both need nothing the image lacks),
# and the device call names .whl in `carry`; this script installs .whl/*.whl into /tmp/site when present.
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
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH" || echo "warning: installing .whl/*.whl failed"
fi
REPORT="$DIR/gpu_acceptance.md"
: > "$REPORT"
FAILED=()

if [ "$SMOKE" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_acceptance.sh: CUDA is not available: nothing measured (--cpu-smoke runs the code on tiny shapes)" \
    | tee -a "$REPORT"
  exit 2
fi

# The whole run must end inside one device call (10 minutes): each step gets at most what is left of BUDGET_S.
BUDGET_S="${GPU_ACCEPTANCE_BUDGET_S:-540}"

# step NAME LIMIT_S CORRECTNESS(0/1) COMMAND...: run with a time limit, output to the terminal and the report
step() {
  local name="$1" limit="$2" correctness="$3"; shift 3
  local left=$((BUDGET_S - SECONDS - 15))
  if [ "$left" -lt 20 ]; then
    echo "## $name: SKIPPED, the time budget ($BUDGET_S s) is spent" | tee -a "$REPORT"
    if [ "$correctness" = 1 ]; then FAILED+=("$name (not run: time budget)"); fi
    return
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  echo "## $name" | tee -a "$REPORT"
  echo '```' >> "$REPORT"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$REPORT"
  rc=${PIPESTATUS[0]}
  echo '```' >> "$REPORT"
  echo "($name: exit $rc, $((SECONDS - t0)) s)" | tee -a "$REPORT"
  if [ "$rc" != 0 ] && [ "$correctness" = 1 ]; then FAILED+=("$name (exit $rc)"); fi
  if [ "$rc" != 0 ] && [ "$correctness" = 0 ]; then echo "note: $name exited $rc" | tee -a "$REPORT"; fi
}

{
  echo "# GPU acceptance: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" - <<'EOF'
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
for name in ("triton", "megatron.core", "liger_kernel", "cut_cross_entropy"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{name}: not available ({exc.__class__.__name__})")
EOF
  echo '```'
} 2>&1 | tee -a "$REPORT"

if [ "$SMOKE" = 1 ]; then
  step correctness 300 1 "$PY" benchmarks/gpu_acceptance.py --device cpu --tiny --json "$DIR/correctness.json"
  step logprob_kernel_bench 300 1 "$PY" benchmarks/bench_logprobs_kernel.py --cpu-smoke --json "$DIR/logprob_kernel.json"
  step megatron_step 300 0 "$PY" benchmarks/bench_megatron_step.py --device cpu --tiny \
    --json "$DIR/megatron_step.json"
  step loss_hook_1m_tokens 300 0 "$PY" benchmarks/gpu_check_megatron.py --device cpu --tokens 4096 \
    --micro-tokens 2048 --seq-len 512 --vocab 512
else
  step correctness 240 1 "$PY" benchmarks/gpu_acceptance.py --json "$DIR/correctness.json"
  step core_no_host_sync 120 1 "$PY" benchmarks/gpu_check_core.py
  step logprob_kernel_bench 180 1 "$PY" benchmarks/bench_logprobs_kernel.py --json "$DIR/logprob_kernel.json"
  step output_layer_bench 180 0 "$PY" benchmarks/bench_output_layer.py --json "$DIR/output_layer.json"
  step megatron_step 180 0 "$PY" benchmarks/bench_megatron_step.py --json "$DIR/megatron_step.json"
  step loss_hook_1m_tokens 120 0 "$PY" benchmarks/gpu_check_megatron.py
fi

echo "## summary" | tee -a "$REPORT"
"$PY" benchmarks/gpu_acceptance.py --summary "$DIR" 2>&1 | tee -a "$REPORT"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "CORRECTNESS FAILED: ${FAILED[*]}" | tee -a "$REPORT"
  exit 1
fi
echo "correctness: all passed (see the summary for the speed targets)" | tee -a "$REPORT"
exit 0
