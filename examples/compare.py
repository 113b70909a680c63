"""Run the example job under several algorithms x mismatch settings and print a comparison table.

    python -m examples.compare --algs 0 2-geo-mis --mismatch lag2 --steps 50         # quickstart
    python -m examples.compare --algs 0 1 2 3 --mismatch none bf16 lag2 --seeds 0 1 2  # results table
    python -m examples.compare --table-only --out-dir runs/compare ...                # re-print from logs

Algorithms are selected by the plugin's flags only (``ALG_FLAGS``: ``0``-``3`` with default TIS settings =
token-level truncation at 2; ``2-geo-mis`` / ``3-geo-mis`` = geometric-mean masking with bounds
[1/1.5, 1.5], the setting ``slime-tis diagnose`` recommends on this job's lag-2 dumps; ``2-tok-mis`` /
``3-tok-mis`` = token-level masking at [0.5, 2]). Mismatch settings (``MISMATCH``):

* ``none``  - engine decodes in float32 (same math as training up to summation order);
* ``bf16``  - engine decodes in bfloat16 with a KV cache (the default training/inference mismatch);
* ``lag2``  - bf16 and ``--rollout-lag 2`` (rollouts from the policy of two steps ago);
* ``noise`` - bf16 and ``--rollout-logit-noise 0.5`` (a strong, injected behaviour-policy shift).

Each run goes to ``OUT_DIR/<mismatch>-alg<k>-s<seed>`` (run directory of ``examples.rl.train``). Columns:
final reward (mean of the last 5 steps), max ``tis/k3_kl`` and max grad norm over the run, mean rejected
token fraction, wall time of the run; with several seeds, mean +- std over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

GEO_MIS = ["--tis-mode", "mask", "--tis-level", "geometric", "--tis-upper-bound", "1.5"]
TOKEN_MIS = ["--tis-mode", "mask", "--tis-level", "token"]
#: algorithm variants: the plugin's flags only (the number is the algorithm; a suffix names the TIS settings)
ALG_FLAGS: dict[str, list[str]] = {
    "0": [],
    "1": ["--use-rollout-log-probs"],
    "2": ["--use-tis"],
    "3": ["--use-rollout-log-probs", "--use-tis"],
    "2-geo-mis": ["--use-tis", *GEO_MIS],
    "3-geo-mis": ["--use-rollout-log-probs", "--use-tis", *GEO_MIS],
    "2-tok-mis": ["--use-tis", *TOKEN_MIS],
    "3-tok-mis": ["--use-rollout-log-probs", "--use-tis", *TOKEN_MIS],
}
MISMATCH: dict[str, list[str]] = {
    "none": ["--engine-dtype", "float32"],
    "bf16": [],
    "lag2": ["--rollout-lag", "2"],
    "noise": ["--rollout-logit-noise", "0.5"],
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ("mismatch", "alg", "final reward", "max tis/k3_kl", "max grad norm", "rejected frac", "wall s")


def run_dir(out_dir: str, mismatch: str, alg: str, seed: int) -> str:
    return os.path.join(out_dir, f"{mismatch}-alg{alg}-s{seed}")


def launch(out_dir: str, mismatch: str, alg: str, seed: int, steps: int, nproc: int, extra: list[str]) -> float:
    """Run one training job (a subprocess) and return its wall time in seconds."""
    d = run_dir(out_dir, mismatch, alg, seed)
    train = [
        "-m",
        "examples.rl.train",
        "--run-dir",
        d,
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--no-progress",
        *ALG_FLAGS[alg],
        *MISMATCH[mismatch],
        *extra,
    ]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *train]
    else:
        cmd = [sys.executable, *train]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"run {d} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(os.path.join(d, "wall_time.json"), "w", encoding="utf-8") as f:
        json.dump({"wall_s": wall, "cmd": cmd}, f)
    return wall


def summarize(d: str) -> dict[str, float]:
    """One run's table entries from its ``metrics.jsonl``."""
    rows: dict[int, dict] = {}
    with open(os.path.join(d, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows[r["step"]] = r
    ordered = [rows[k] for k in sorted(rows)]

    def values(key: str) -> list[float]:
        return [r[key] for r in ordered if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]

    rewards = values("reward")
    k3, gn, rej = values("tis/k3_kl"), values("grad_norm"), values("tis/rejected_token_fraction")
    wall = float("nan")
    if os.path.exists(os.path.join(d, "wall_time.json")):
        with open(os.path.join(d, "wall_time.json"), encoding="utf-8") as f:
            wall = json.load(f)["wall_s"]
    return {
        "final reward": sum(rewards[-5:]) / max(len(rewards[-5:]), 1),
        "initial reward": sum(rewards[:5]) / max(len(rewards[:5]), 1),
        "max tis/k3_kl": max(k3) if k3 else float("nan"),
        "max grad norm": max(gn) if gn else float("nan"),
        "rejected frac": sum(rej) / len(rej) if rej else 0.0,
        "wall s": wall,
    }


def _fmt(values: list[float], key: str) -> str:
    fmt = {
        "final reward": "{:.3f}",
        "max tis/k3_kl": "{:.2e}",
        "max grad norm": "{:.2f}",
        "rejected frac": "{:.3f}",
        "wall s": "{:.0f}",
    }[key]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "n/a"
    if len(finite) == 1:
        return fmt.format(finite[0])
    return f"{fmt.format(statistics.mean(finite))} ± {fmt.format(statistics.stdev(finite))}"


def table(out_dir: str, mismatches: list[str], algs: list[str], seeds: list[int]) -> str:
    """A markdown table over the runs found in ``out_dir``."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for mm in mismatches:
        for alg in algs:
            sums = [
                summarize(run_dir(out_dir, mm, alg, s))
                for s in seeds
                if os.path.exists(os.path.join(run_dir(out_dir, mm, alg, s), "metrics.jsonl"))
            ]
            if not sums:
                continue
            cells = [mm, alg] + [_fmt([x[c] for x in sums], c) for c in COLUMNS[2:]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m examples.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--algs",
        nargs="+",
        default=["0", "2-geo-mis"],
        choices=list(ALG_FLAGS),
        help="algorithm variants (see ALG_FLAGS): 0-3, or 2/3 with -geo-mis / -tok-mis TIS settings",
    )
    p.add_argument("--mismatch", nargs="+", default=["lag2"], choices=sorted(MISMATCH))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun, data parallel)")
    p.add_argument("--out-dir", default="runs/compare")
    p.add_argument("--table-only", action="store_true", help="do not train; tabulate existing runs")
    p.add_argument("--plot", action="store_true", help="also write OUT_DIR/compare.png (first seed)")
    p.add_argument("--train-args", default="", help='extra flags for every run, e.g. "--tis-mode mask"')
    args = p.parse_args(argv)
    extra = args.train_args.split()
    if not args.table_only:
        total = len(args.mismatch) * len(args.algs) * len(args.seeds)
        n = 0
        for mm in args.mismatch:
            for alg in args.algs:
                for seed in args.seeds:
                    n += 1
                    print(f"[{n}/{total}] mismatch={mm} alg={alg} seed={seed} ...", end=" ", flush=True)
                    print(f"{launch(args.out_dir, mm, alg, seed, args.steps, args.nproc, extra):.0f} s", flush=True)
    out = table(args.out_dir, args.mismatch, args.algs, args.seeds)
    print(out)
    with open(os.path.join(args.out_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write(out + "\n")
    if args.plot:
        from slime_tis.plot import main as plot_main

        dirs = [run_dir(args.out_dir, mm, alg, args.seeds[0]) for mm in args.mismatch for alg in args.algs]
        plot_main([*dirs, "-o", os.path.join(args.out_dir, "compare.png"), "--smooth", "3"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
