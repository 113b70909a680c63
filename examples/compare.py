"""Run the example job under several algorithms x mismatch settings and print a comparison table.

    python -m examples.compare --algs 0 2 2-auto --mismatch lag2 --seeds 22 23 --steps 40 \
        -- --steps-per-rollout 2 --ppo-epochs 2 --lr 1e-2                         # quickstart
    python -m examples.compare --algs 0 1 2 2-geo-mis 3-geo-mis 2-tok-mis \
        --mismatch none int8 fp8 lag2 --seeds 0 1 2 3 4 --jobs 4 -- --steps-per-rollout 4   # results table
    python -m examples.compare --table-only --out-dir runs/compare ...                # re-print from logs

Everything after ``--`` is passed to every ``examples.rl.train`` run (as is ``--train-args "..."``).

Algorithms are selected by the plugin's flags only (``ALG_FLAGS``: ``0``-``3`` with default TIS settings =
token-level truncation at 2; ``2-geo-mis`` / ``3-geo-mis`` = geometric-mean masking with bounds
[1/1.5, 1.5], the setting ``slime-tis diagnose`` recommends on this job's lag-2 dumps; ``2-tok-mis`` /
``3-tok-mis`` = token-level masking at [0.5, 2], IcePop-style; ``3-seq`` = sequence-level truncation at 2;
``2-auto`` = the searched bound at target ESS 0.9, ``2-m2po`` = M2PO at tau 0.04, ``2-kpop`` = truncation at 2
with KPop's binary-KL rejection at phi 0.1).
Mismatch settings (``MISMATCH``):

* ``none``  - engine decodes in float32 (same math as training up to summation order);
* ``bf16``  - engine decodes in bfloat16 with a KV cache (the default training/inference mismatch);
* ``bf16-head32`` - bf16 with the LM head and logits in float32 (``--engine-lm-head-fp32``);
* ``int8`` / ``fp8`` - bf16 engine serving weight-only int8 / fp8-e4m3 linear layers (per output channel);
* ``fp8-tensor`` - the same fp8 with one scale per weight tensor;
* ``lag2``  - bf16 and ``--rollout-lag 2`` (rollouts from the policy of two steps ago);
* ``noise`` - bf16 and ``--rollout-logit-noise 0.5`` (a strong, injected behaviour-policy shift);
* ``moe``   - bf16 engine, mixture-of-experts model (4 experts, top-2): the bf16 router sends some tokens to
  other experts than the float32 training router;
* ``moe-replay`` - the same with rollout routing replay (training uses the engine's experts);
* ``moe-fp32`` / ``moe-fp32-replay`` - the MoE model under a float32 engine, without / with replay (the control:
  the engine routes as training does, so replay can only act by freezing routing across the rollout's
  optimizer steps).

Each run goes to ``OUT_DIR/<mismatch>-alg<k>-s<seed>`` (run directory of ``examples.rl.train``). Columns:
final reward (mean of the last ``FINAL_STEPS`` = 10 steps) with its 95 % t confidence interval over seeds; the
paired difference to algorithm 0 under the same mismatch and seeds, ``*`` when its 95 % interval excludes 0
(paired t-test, :mod:`examples.stats`); the same two for the mean reward over all steps (learning speed: runs
that all plateau near 1 can still differ in how fast they get there); mean and max ``tis/k3_kl`` (mean over
seeds with 95 % CI); the run's largest grad norm as median [min, max] over seeds (heavy-tailed: one spike of
1e5 makes a t interval meaningless) and the number of steps with grad norm > ``GRAD_SPIKE`` = 5; mean rejected
token fraction; wall time; for MoE runs also the mean fraction of routing decisions where training used other
experts than the engine (``moe/routing_mismatch``) and where its router would have chosen others
(``moe/router_disagreement``; equal without replay).
``*`` marks a ``Δ`` whose 95 % interval excludes 0 (5 % per comparison), ``**`` one that also survives Holm's
correction over all ``Δ`` cells of the table (:func:`examples.stats.holm`).
``--columns stale`` keeps final reward and ``tis/k3_kl`` against algorithm 0 (the latter as the geometric-mean
ratio with its 95 % paired interval, the t interval of the per-seed ``log(k3 / k3_0)``), the grad norm range,
rejected fraction and wall time; Holm then runs over those two comparisons per variant.
``--headline`` trains nothing and prints what these runs measured. With one mismatch setting (the quickstart's
closing lines): each algorithm against the first, per seed the final reward, largest grad norm and mean
``tis/k3_kl``, over the seeds how often the final reward is higher and how many runs have a grad-norm spike. With
several settings: ``tis/k3_kl`` of each setting against the first, per seed the mean, the ratio and the steps
where it is lower; over the seeds how many agree, the geometric-mean ratio with its 95 % paired interval, the
ratio of per-step medians, and a verdict.
``--plot`` writes ``OUT_DIR/compare.png`` (every run of the first seed, titled with it) and, with several seeds,
``OUT_DIR/bands.png`` (per-step mean and 95 % band of reward, ``tis/k3_kl``, rejected fraction and grad norm).
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
from concurrent.futures import ThreadPoolExecutor

from examples.stats import Interval, holm, mean_ci, paired_difference, sign_test_p

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
    "3-seq": ["--use-rollout-log-probs", "--use-tis", "--tis-level", "sequence"],
    # algorithm 2 with the global searches and KPop (the stale-rollout table, GRID=stale)
    "2-auto": ["--use-tis", "--tis-upper-bound", "auto", "--tis-target-ess", "0.9"],
    "2-m2po": ["--use-tis", "--tis-m2po-threshold", "0.04"],
    "2-kpop": ["--use-tis", "--tis-binary-kl-threshold", "0.1"],
}
MOE = ["--moe-experts", "4", "--moe-topk", "2"]
MISMATCH: dict[str, list[str]] = {
    "none": ["--engine-dtype", "float32"],
    "bf16": [],
    "bf16-head32": ["--engine-lm-head-fp32"],
    "int8": ["--engine-quant", "int8"],
    "fp8": ["--engine-quant", "fp8"],
    "fp8-tensor": ["--engine-quant", "fp8-tensor"],
    "lag2": ["--rollout-lag", "2"],
    "noise": ["--rollout-logit-noise", "0.5"],
    "moe": MOE,
    "moe-replay": [*MOE, "--routing-replay"],
    "moe-fp32": [*MOE, "--engine-dtype", "float32"],
    "moe-fp32-replay": [*MOE, "--engine-dtype", "float32", "--routing-replay"],
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the final reward is the mean over this many last steps (the runs are chosen long enough to plateau)
FINAL_STEPS = 10
#: a step's grad norm above this counts as a spike (every algorithm-2 run of the results table stays below 1.5)
GRAD_SPIKE = 5.0
#: (header, summary key, how it is summarised over seeds): ``ci`` = mean with 95 % t interval, ``delta`` = paired
#: difference to algorithm 0 (``*`` = significant at 5 %), ``range`` = median [min, max] (heavy-tailed values)
TABLE: tuple[tuple[str, str, str], ...] = (
    ("final reward (95% CI)", "final reward", "ci"),
    ("Δ final vs alg 0", "final reward", "delta"),
    ("mean reward over the run (95% CI)", "mean reward", "ci"),
    ("Δ mean vs alg 0", "mean reward", "delta"),
    ("mean tis/k3_kl", "mean tis/k3_kl", "ci"),
    ("max tis/k3_kl", "max tis/k3_kl", "ci"),
    ("max grad norm: median [min, max]", "max grad norm", "range"),
    (f"steps with grad norm > {GRAD_SPIKE:g}", "grad spikes", "ci"),
    ("rejected frac", "rejected frac", "ci"),
    ("wall s", "wall s", "ci"),
)
#: the stale-rollout table (``--columns stale``): ``ratio`` = geometric-mean ratio to algorithm 0 over seeds with
#: its 95 % paired interval (t interval of the per-seed ``log(x / x_0)``), tested like a ``delta``
TABLE_STALE: tuple[tuple[str, str, str], ...] = (
    ("final reward (95% CI)", "final reward", "ci"),
    ("Δ final vs alg 0", "final reward", "delta"),
    ("mean tis/k3_kl (95% CI)", "mean tis/k3_kl", "ci"),
    ("tis/k3_kl / alg 0: geometric mean [95% CI]", "mean tis/k3_kl", "ratio"),
    ("max grad norm: median [min, max]", "max grad norm", "range"),
    ("rejected frac", "rejected frac", "ci"),
    ("wall s", "wall s", "ci"),
)
COLUMN_SETS = {"full": TABLE, "stale": TABLE_STALE}
#: extra columns when a MoE setting is in the table
TABLE_MOE: tuple[tuple[str, str, str], ...] = (
    ("routing mismatch (used vs engine)", "mean moe/routing_mismatch", "ci"),
    ("router disagreement", "mean moe/router_disagreement", "ci"),
)
COLUMNS = ("mismatch", "alg", *(header for header, _, _ in TABLE))


def run_dir(out_dir: str, mismatch: str, alg: str, seed: int) -> str:
    return os.path.join(out_dir, f"{mismatch}-alg{alg}-s{seed}")


def launch(out_dir: str, mismatch: str, alg: str, seed: int, steps: int, nproc: int, extra: list[str]) -> float:
    """Run one training job (a subprocess) and return its wall time in seconds. Unless ``OMP_NUM_THREADS`` is
    set, every process runs one thread: a run's numbers then do not depend on ``--jobs`` or the core count (the
    thread count changes float32 reduction order, and a run's trajectory with it)."""
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
        "--overwrite",  # the run directory belongs to this comparison: a repeated invocation starts it anew
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
    env.setdefault("OMP_NUM_THREADS", "1")
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
    from examples.plot import read_run

    keys = ("reward", "moe/routing_mismatch", "moe/router_disagreement", "tis/k3_kl", "grad_norm",
            "tis/rejected_token_fraction")
    ordered = read_run(d, fields=keys)  # malformed rows and values: a ValueError naming file, line, field

    def values(key: str) -> list[float]:
        return [r[key] for r in ordered if r.get(key) is not None]

    rewards = values("reward")
    moe_used, moe_own = values("moe/routing_mismatch"), values("moe/router_disagreement")
    k3, gn, rej = values("tis/k3_kl"), values("grad_norm"), values("tis/rejected_token_fraction")
    wall = float("nan")
    if os.path.exists(os.path.join(d, "wall_time.json")):
        with open(os.path.join(d, "wall_time.json"), encoding="utf-8") as f:
            wall = json.load(f)["wall_s"]
    return {
        "final reward": sum(rewards[-FINAL_STEPS:]) / max(len(rewards[-FINAL_STEPS:]), 1),
        "mean reward": sum(rewards) / max(len(rewards), 1),
        "grad spikes": float(sum(g > GRAD_SPIKE for g in gn)),
        "mean tis/k3_kl": sum(k3) / len(k3) if k3 else float("nan"),
        "max tis/k3_kl": max(k3) if k3 else float("nan"),
        "max grad norm": max(gn) if gn else float("nan"),
        "rejected frac": sum(rej) / len(rej) if rej else 0.0,
        "wall s": wall,
        "mean moe/routing_mismatch": sum(moe_used) / len(moe_used) if moe_used else float("nan"),
        "mean moe/router_disagreement": sum(moe_own) / len(moe_own) if moe_own else float("nan"),
    }


FORMATS = {
    "final reward": "{:.3f}",
    "mean reward": "{:.3f}",
    "grad spikes": "{:.1f}",
    "mean tis/k3_kl": "{:.2e}",
    "max tis/k3_kl": "{:.2e}",
    "max grad norm": "{:.2f}",
    "rejected frac": "{:.3f}",
    "wall s": "{:.0f}",
    "mean moe/routing_mismatch": "{:.4f}",
    "mean moe/router_disagreement": "{:.4f}",
}


def _fmt_ci(iv: Interval, fmt: str, signed: bool = False) -> str:
    """``mean ± half`` (the 95 % half width; the bare mean for one seed); ``n/a`` for no finite value."""
    if iv.n == 0:
        return "n/a"
    m = fmt.replace("{:", "{:+") if signed else fmt
    return m.format(iv.mean) if iv.n == 1 else f"{m.format(iv.mean)} ± {fmt.format(iv.half)}"


def _fmt_median_range(values: list[float], fmt: str) -> str:
    """``median [min, max]`` of the finite ``values``; ``n/a`` for none."""
    x = sorted(v for v in values if math.isfinite(v))
    if not x:
        return "n/a"
    return f"{fmt.format(statistics.median(x))} [{fmt.format(x[0])}, {fmt.format(x[-1])}]"


def _runs(out_dir: str, mm: str, alg: str, seeds: list[int]) -> dict[int, dict[str, float]]:
    return {
        s: summarize(run_dir(out_dir, mm, alg, s))
        for s in seeds
        if os.path.exists(os.path.join(run_dir(out_dir, mm, alg, s), "metrics.jsonl"))
    }


def _fmt_ratio(iv: Interval) -> str:
    """A paired interval of ``log(x / x_0)`` as ``ratio [low, high]`` (the bare ratio for one seed)."""
    if iv.n == 0:
        return "n/a"
    if iv.n == 1:
        return f"{math.exp(iv.mean):.3g}x"
    return f"{math.exp(iv.mean):.3g}x [{math.exp(iv.low):.3g}x, {math.exp(iv.high):.3g}x]"


def _log(values: dict[int, float]) -> dict[int, float]:
    """``log`` of the positive finite values (a zero or missing one drops out of the pairing)."""
    return {s: math.log(v) for s, v in values.items() if math.isfinite(v) and v > 0}


def table(out_dir: str, mismatches: list[str], algs: list[str], seeds: list[int], columns: str = "full") -> str:
    """A markdown table over the runs found in ``out_dir`` (columns: ``COLUMN_SETS[columns]``, and ``TABLE_MOE``
    when a ``moe`` setting is among ``mismatches``; see the module docstring). A ``Δ`` or ratio cell ends in
    ``*`` when its 95 % interval excludes 0 (ratio: 1), in ``**`` when it also survives Holm's correction over
    all such cells of the table (the comparisons against algorithm 0)."""
    spec = COLUMN_SETS[columns] + (TABLE_MOE if any(mm.startswith("moe") for mm in mismatches) else ())
    rows: list[list[str]] = []
    deltas: list[tuple[int, int, Interval]] = []  # (row, column, paired difference) of every Δ cell
    for mm in mismatches:
        base = _runs(out_dir, mm, "0", seeds)
        for alg in algs:
            runs = _runs(out_dir, mm, alg, seeds)
            if not runs:
                continue
            cells = [mm, alg]
            for _, key, how in spec:
                values = {s: r[key] for s, r in runs.items()}
                if how == "range":
                    cells.append(_fmt_median_range(list(values.values()), FORMATS[key]))
                elif how == "ci":
                    cells.append(_fmt_ci(mean_ci(list(values.values())), FORMATS[key]))
                elif alg == "0":
                    cells.append("—")
                elif not base:
                    cells.append("n/a")
                elif how == "ratio":
                    d = paired_difference(_log(values), _log({s: r[key] for s, r in base.items()}))
                    deltas.append((len(rows), len(cells), d))
                    cells.append(_fmt_ratio(d))
                else:
                    d = paired_difference(values, {s: r[key] for s, r in base.items()})
                    deltas.append((len(rows), len(cells), d))
                    cells.append(_fmt_ci(d, FORMATS[key], signed=True))
            rows.append(cells)
    adjusted = holm([d.p for _, _, d in deltas])
    for (r, c, d), p_holm in zip(deltas, adjusted):
        if d.excludes_zero:
            rows[r][c] += " **" if p_holm <= 0.05 else " *"
    header = ("mismatch", "alg", *(name for name, _, _ in spec))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def _k3_by_step(d: str) -> dict[int, float]:
    from examples.plot import read_run

    return {r["step"]: r["tis/k3_kl"] for r in read_run(d, fields=("tis/k3_kl",)) if r.get("tis/k3_kl") is not None}


def _ratio(x: float) -> str:
    return f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def headline(out_dir: str, mismatches: list[str], algs: list[str], seeds: list[int]) -> str:
    """What this run measured, setting by setting against the first (``mismatches[0]``), per algorithm.

    Per seed: each setting's mean ``tis/k3_kl`` (and ``moe/routing_mismatch`` where logged), the ratio
    ``k3(first) / k3(setting)`` and on how many steps the setting's k3 is lower. Then, over the seeds: on how many
    seeds it is lower (with the two-sided sign test's p), the geometric-mean ratio with its 95 % paired interval
    (t interval over seeds of ``log(ratio)``, transformed back), the per-step count over all (seed, step) pairs,
    the ratio of per-step medians per seed, and a one-line verdict that states only what these show."""
    lines = []
    for alg in algs:
        ratios: dict[str, list[float]] = {mm: [] for mm in mismatches[1:]}
        step_ratio: dict[str, list[float]] = {mm: [] for mm in mismatches[1:]}
        steps_lower: dict[str, list[int]] = {mm: [0, 0] for mm in mismatches[1:]}
        for seed in seeds:
            parts = []
            first: dict[int, float] | None = None
            first_mean = float("nan")
            for mm in mismatches:
                d = run_dir(out_dir, mm, alg, seed)
                if not os.path.exists(os.path.join(d, "metrics.jsonl")):
                    continue
                r = summarize(d)
                text = f"{mm}: k3_kl {r['mean tis/k3_kl']:.2e}"
                if math.isfinite(r["mean moe/routing_mismatch"]):
                    text += f", routing mismatch {r['mean moe/routing_mismatch']:.4f}"
                per_step = _k3_by_step(d)
                if mm == mismatches[0]:
                    first, first_mean = per_step, r["mean tis/k3_kl"]
                elif first is not None and r["mean tis/k3_kl"] > 0 and first_mean > 0:
                    ratios[mm].append(first_mean / r["mean tis/k3_kl"])
                    common = sorted(first.keys() & per_step.keys())
                    lower = sum(per_step[s] < first[s] for s in common)
                    steps_lower[mm][0] += lower
                    steps_lower[mm][1] += len(common)
                    med = statistics.median(per_step[s] for s in common) if common else 0.0
                    if med > 0:
                        step_ratio[mm].append(statistics.median(first[s] for s in common) / med)
                    text += f" (ratio {_ratio(ratios[mm][-1])}; lower on {lower} of {len(common)} steps)"
                parts.append(text)
            lines.append(f"alg {alg} seed {seed}: " + " | ".join(parts))
        for mm, rs in ratios.items():
            if rs:
                lines.extend(_verdict(alg, mismatches[0], mm, rs, step_ratio[mm], steps_lower[mm]))
    return "\n".join(lines)


def headline_algs(out_dir: str, mismatch: str, algs: list[str], seeds: list[int]) -> str:
    """What the runs measured, each algorithm against the first (``algs[0]``, algorithm 0 in the quickstart),
    under one mismatch setting: per seed each run's final reward, largest grad norm and mean ``tis/k3_kl``; over
    the seeds on how many the final reward is higher than the first's, and how many runs of each have a step with
    grad norm above ``GRAD_SPIKE`` (the stale-rollout failure of uncorrected PPO). Only what these runs show:
    a few seeds make no statistical claim (docs/results.md has the 5-seed table)."""
    runs = {alg: _runs(out_dir, mismatch, alg, seeds) for alg in algs}
    lines = []
    for seed in seeds:
        parts = [f"alg {alg}: final reward {r['final reward']:.2f}, max grad norm {r['max grad norm']:.3g}, "
                 f"k3_kl {r['mean tis/k3_kl']:.2e}" for alg in algs if (r := runs[alg].get(seed))]
        lines.append(f"{mismatch} seed {seed}: " + " | ".join(parts))
    first = runs[algs[0]]
    spikes = {alg: sum(r["max grad norm"] > GRAD_SPIKE for r in rs.values()) for alg, rs in runs.items()}
    for alg in algs[1:]:
        common = sorted(first.keys() & runs[alg].keys())
        if not common:
            continue
        higher = sum(runs[alg][s]["final reward"] > first[s]["final reward"] for s in common)
        lines.append(f"alg {alg} vs alg {algs[0]}: final reward higher on {higher} of {len(common)} seeds; runs with "
                     f"a grad norm > {GRAD_SPIKE:g}: {spikes[alg]} of {len(runs[alg])} (alg {algs[0]}: "
                     f"{spikes[algs[0]]} of {len(first)})")
    return "\n".join(lines)


def _verdict(alg: str, first: str, mm: str, rs: list[float], step_rs: list[float], steps: list[int]) -> list[str]:
    """The over-seeds summary lines of :func:`headline` for one setting against the first."""
    n_lower = sum(r > 1 for r in rs)
    iv = mean_ci([math.log(r) for r in rs])
    out = [
        f"alg {alg}, {mm} vs {first}: mean tis/k3_kl lower under {mm} on {n_lower} of {len(rs)} seeds "
        f"(ratio per seed {', '.join(_ratio(r) for r in rs)}; sign test p = {sign_test_p(n_lower, len(rs)):.3g})"
    ]
    if iv.n >= 2:
        out.append(
            f"  geometric-mean ratio {_ratio(math.exp(iv.mean))}, 95 % paired interval over seeds "
            f"[{_ratio(math.exp(iv.low))}, {_ratio(math.exp(iv.high))}]"
        )
    if steps[1]:
        spread = f"{_ratio(min(step_rs))}-{_ratio(max(step_rs))}" if step_rs else "n/a"
        out.append(
            f"  per step: lower on {steps[0]} of {steps[1]} (seed, step) pairs; "
            f"ratio of per-step medians {spread} over seeds"
        )
    if n_lower == len(rs) and iv.excludes_zero:
        verdict = f"lower on every seed, and the paired interval excludes 1x: {mm} lowers the mismatch in these runs"
    elif n_lower == len(rs):
        why = "one seed gives no interval" if iv.n < 2 else "the paired interval includes 1x"
        verdict = (
            f"lower on every seed, but {len(rs)} seeds do not rule out chance ({why}; sign test p = "
            f"{sign_test_p(n_lower, len(rs)):.3g}): more seeds (SEEDS=...) make it a statistical claim"
        )
    else:
        verdict = f"lower on {n_lower} of {len(rs)} seeds only: no consistent direction in these runs"
    out.append(f"  verdict: {verdict}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_extra = argv[:cut], argv[cut + 1 :]
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
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (one CPU core each is a good start)")
    p.add_argument("--out-dir", default="runs/compare")
    p.add_argument("--table-only", action="store_true", help="do not train; tabulate existing runs")
    p.add_argument("--plot", action="store_true", help="also write OUT_DIR/compare.png (and bands.png)")
    p.add_argument(
        "--headline",
        action="store_true",
        help="do not train; print what the runs measured: k3_kl of each setting vs the first, per seed and over seeds",
    )
    p.add_argument(
        "--columns",
        choices=sorted(COLUMN_SETS),
        default="full",
        help="full: every column; stale: final reward and tis/k3_kl against algorithm 0 (GRID=stale)",
    )
    p.add_argument("--train-args", default="", help='extra flags for every run, e.g. "--tis-mode mask"')
    args = p.parse_args(argv)
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    extra = args.train_args.split() + train_extra
    if args.headline and len(args.mismatch) == 1:
        print(headline_algs(args.out_dir, args.mismatch[0], args.algs, args.seeds))
        return 0
    if args.headline:
        print(headline(args.out_dir, args.mismatch, args.algs, args.seeds))
        return 0
    if not args.table_only:
        grid = [(mm, alg, seed) for mm in args.mismatch for alg in args.algs for seed in args.seeds]
        os.makedirs(args.out_dir, exist_ok=True)

        def one(item: tuple[str, str, int]) -> str:
            mm, alg, seed = item
            wall = launch(args.out_dir, mm, alg, seed, args.steps, args.nproc, extra)
            return f"mismatch={mm} alg={alg} seed={seed}: {wall:.0f} s"

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for n, msg in enumerate(pool.map(one, grid), 1):
                print(f"[{n}/{len(grid)}] {msg}", flush=True)
        print(f"grid of {len(grid)} runs: {time.perf_counter() - t0:.0f} s wall", flush=True)
    out = table(args.out_dir, args.mismatch, args.algs, args.seeds, args.columns)
    print(out)
    with open(os.path.join(args.out_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write(out + "\n")
    if args.plot:
        from examples.plot import main as plot_main

        dirs = [run_dir(args.out_dir, mm, alg, args.seeds[0]) for mm in args.mismatch for alg in args.algs]
        title = f"seed {args.seeds[0]}"
        if len(args.seeds) > 1:
            title += f" only (bands.png: mean and 95 % band over seeds {' '.join(map(str, args.seeds))})"
        plot_main([*dirs, "-o", os.path.join(args.out_dir, "compare.png"), "--smooth", "3", "--title", title])
        if len(args.seeds) > 1:
            from examples.plot_bands import plot_bands

            groups = {
                f"{mm} alg {alg}": [run_dir(args.out_dir, mm, alg, s) for s in args.seeds]
                for mm in args.mismatch
                for alg in args.algs
            }
            plot_bands(groups, os.path.join(args.out_dir, "bands.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
