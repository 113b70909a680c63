"""``python -m examples.plot RUN_DIR [RUN_DIR ...]``: the example job's training curves of one or more runs as a PNG.

Each run directory holds ``metrics.jsonl`` (one JSON object per step with at least ``step``; written by
the example job, ``examples/rl/train.py``). One panel per metric, every run overlaid in each panel
(runs side by side per metric):

* ``reward`` - mean sequence reward of the step's rollouts;
* ``tis/kl`` - mean(lp_rollout - lp_train) over valid tokens;
* ``tis/k3_kl`` - mean(r - 1 - log r), r = pi_train / pi_rollout per token;
* ``grad_norm`` - global gradient norm before clipping;
* ``tis/rejected_token_fraction`` - fraction of valid tokens rejected (mask mode, RS, veto, non-finite).

A metric absent from a run is skipped for that run (e.g. algorithm 0 without rollout log-probs). ``tis/k3_kl``
and the grad norm are drawn on a log axis, where a value <= 0 is a gap.
``--smooth k`` draws a trailing moving average of ``k`` steps over the raw curve. Uses matplotlib's
Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

from slime_tis.tools.jsonl import read_jsonl

DEFAULT_METRICS = ("reward", "tis/kl", "tis/k3_kl", "grad_norm", "tis/rejected_token_fraction")
TITLES = {
    "reward": "reward",
    "tis/kl": "tis/kl  (rollout vs train)",
    "tis/k3_kl": "tis/k3_kl",
    "grad_norm": "grad norm",
    "tis/rejected_token_fraction": "rejected token fraction",
}


#: the largest magnitude a plotted value may have: an axis from -MAX_VALUE to MAX_VALUE (plus margins) still
#: has a finite length; a larger value is no metric the job writes but a corrupted record
MAX_VALUE = 1e300


def metric_value(v: object, where: str, key: str) -> float | None:
    """The value of field ``key`` of a metrics row as a float, or None for no point (``null``: the job writes
    non-finite values so; NaN, +-inf). A non-number (string, bool, list, ...) or a number beyond
    +-:data:`MAX_VALUE` (a 400-digit integer, 1e308) is a ``ValueError`` naming ``where`` and the field."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}: field {key!r} must be a number or null, got {type(v).__name__} {str(v)[:40]}")
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if abs(v) > MAX_VALUE:  # exact for an int of any size (no float conversion)
        shown = f"{v:.3g}" if isinstance(v, float) else f"an integer of {len(str(abs(v)))} digits"
        raise ValueError(f"{where}: field {key!r} is {shown}, beyond +-{MAX_VALUE:g}: not a metric value")
    return float(v)


def read_run(run_dir: str, notes: list[str] | None = None, fields: Sequence[str] = ()) -> list[dict]:
    """Rows of ``RUN_DIR/metrics.jsonl`` sorted by step (the last row of a repeated step wins).

    A torn last line (a write cut short by a crash) is dropped; the sentence saying so is appended to
    ``notes`` when given. Any other malformed line is a ``ValueError`` naming the file, line and field;
    so is a value of one of ``fields`` (the metrics the caller reads) that :func:`metric_value` refuses.
    In the rows returned, those fields hold floats or None."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir!r} is not a run directory: {path} does not exist or is not a file")
    read = read_jsonl(path)
    if read.torn and notes is not None:
        notes.append(read.torn)
    rows: dict[int, dict] = {}
    for n, row in read.rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: a metrics row must be a JSON object, got {type(row).__name__}")
        if "step" not in row:
            raise ValueError(f"{path}:{n}: a metrics row needs a 'step' field")
        step = row["step"]
        if isinstance(step, float) and math.isfinite(step) and step == int(step):
            step = int(step)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 53:
            raise ValueError(f"{path}:{n}: field 'step' must be an integer >= 0, got {str(step)[:40]}")
        checked = {key: metric_value(row[key], f"{path}:{n}", key) for key in fields if key in row}
        rows[step] = {**row, **checked, "step": step}
    return [rows[k] for k in sorted(rows)]


def run_label(run_dir: str) -> str:
    """The directory name, plus ``alg N`` when ``args.json`` records the algorithm."""
    label = os.path.basename(os.path.normpath(run_dir))
    try:
        with open(os.path.join(run_dir, "args.json"), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError, RecursionError):
        return label
    alg = saved.get("algorithm") if isinstance(saved, dict) else None
    if isinstance(alg, int) and not isinstance(alg, bool):
        label += f" (alg {alg})"
    return label


#: metrics drawn on a log axis; a value <= 0 of these is a gap in the curve (a log axis has no place for it)
LOG_METRICS = ("tis/k3_kl", "grad_norm")


def plotted_series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``steps, values`` of ``key`` as drawn: rows without a value are gaps, and so are values <= 0 on a log
    panel (:data:`LOG_METRICS`; a float32 engine can log ``tis/k3_kl`` = 0 exactly), never a floor value."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)  # a float or None (read_run checked the field)
        if v is not None and (v > 0 or key not in LOG_METRICS):
            xs.append(int(r["step"]))
            ys.append(v)
    return xs, ys


def _moving_average(ys: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot_runs(
    run_dirs: Sequence[str],
    out: str,
    *,
    metrics: Sequence[str] = DEFAULT_METRICS,
    smooth: int = 1,
    title: str | None = None,
) -> str:
    """Write the PNG ``out`` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("plot needs at least one run directory")
    if smooth < 1:
        raise ValueError(f"--smooth must be >= 1, got {smooth}")
    notes: list[str] = []
    runs = [(run_label(d), read_run(d, notes, fields=metrics)) for d in run_dirs]
    for note in notes:
        print(f"examples.plot: note: {note}", file=sys.stderr)
    ncols = min(3, len(metrics))
    nrows = -(-len(metrics) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.4 * nrows), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(metrics) :]:
        ax.axis("off")
    for ax, key in zip(axes, metrics):
        drawn = False
        for i, (label, rows) in enumerate(runs):
            xs, ys = plotted_series(rows, key)
            if not xs:
                continue
            color = f"C{i}" if len(runs) <= 10 else plt.get_cmap("tab20")(i % 20)
            if smooth > 1:
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(xs, _moving_average(ys, smooth), color=color, label=label, linewidth=1.6)
            else:
                ax.plot(xs, ys, color=color, label=label, linewidth=1.4)
            drawn = True
        ax.set_title(TITLES.get(key, key), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key in LOG_METRICS and drawn:
            ax.set_yscale("log")
        elif key in ("reward", "tis/rejected_token_fraction") and drawn:
            ax.set_ylim(bottom=0.0)  # non-negative: no negative axis range, even for an all-zero curve
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    handles, labels = [], []
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            break
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title)
    legend_rows = -(-len(labels) // 4) if handles else 0
    fig.tight_layout(rect=(0, 0.035 * legend_rows / nrows + 0.02, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.plot", description="Training curves of runs as a PNG.")
    p.add_argument("run_dirs", nargs="+", help="run directories containing metrics.jsonl")
    p.add_argument("-o", "--out", default=None, help="output PNG (default: curves.png in the first run dir)")
    p.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), help="metric keys, one panel each")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window in steps (1 = raw)")
    p.add_argument("--title", default=None)
    return p


def main(argv: list[str]) -> int:
    """CLI entry point (``python -m examples.plot``); returns the exit status."""
    from slime_tis.cli import run_reporting_errors

    args = build_parser().parse_args(argv)
    out = args.out or os.path.join(args.run_dirs[0], "curves.png")

    def run() -> int:
        path = plot_runs(args.run_dirs, out, metrics=args.metrics, smooth=args.smooth, title=args.title)
        print(f"wrote {path}")
        return 0

    return run_reporting_errors("examples.plot", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
