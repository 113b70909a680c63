"""Curves with confidence bands: per step, the mean over seeds and its 95 % t interval (:mod:`examples.stats`).

    python -m examples.plot_bands -o bands.png "bf16 alg 0=runs/r/bf16-alg0-s0,runs/r/bf16-alg0-s1" ...

One panel per metric (reward, ``tis/k3_kl`` on a log axis, rejected token fraction, grad norm); one line and
band per group of run directories (the seeds of one variant). A step enters a group's curve only where at
least two seeds logged a finite value. ``--smooth k`` averages each seed over a trailing window of k steps first.

Every metric plotted is non-negative, but a t interval over few seeds can reach below 0 (mean 0.1, half width
0.3). The band's lower edge is clipped at 0 (``max(0, mean - half)``: the interval intersected with the
metric's range; the figure's title says so). On the log axis a step whose mean is <= 0 is left out, and a band
whose lower edge is 0 reaches the panel's bottom (set from the positive values drawn), not an invented floor.
"""

from __future__ import annotations

import argparse

from examples.plot import read_run
from examples.stats import mean_ci

#: (metric key, panel title, log axis); every one is >= 0 by definition (a band is clipped at 0)
METRICS = (
    ("reward", "reward", False),
    ("tis/k3_kl", "tis/k3_kl", True),
    ("tis/rejected_token_fraction", "rejected token fraction", False),
    ("grad_norm", "grad norm", False),
)


def _series(run_dir: str, key: str, smooth: int) -> dict[int, float]:
    rows = read_run(run_dir, fields=(key,))  # malformed rows and values: a ValueError naming file, line, field
    steps = [r["step"] for r in rows]
    raw = [r.get(key) for r in rows]
    out = {}
    for i, s in enumerate(steps):
        window = [v for v in raw[max(0, i - smooth + 1) : i + 1] if v is not None]
        if window:
            out[s] = sum(window) / len(window)
    return out


def band(run_dirs: list[str], key: str, smooth: int = 1) -> tuple[list[int], list[float], list[float], list[float]]:
    """``steps, mean, low, high`` of ``key`` over the runs (steps with >= 2 finite values): the mean and its 95 %
    t interval, the lower edge clipped at 0 (the metrics are non-negative)."""
    per_run = [_series(d, key, smooth) for d in run_dirs]
    steps, mean, low, high = [], [], [], []
    for s in sorted(set().union(*per_run)):
        iv = mean_ci([r[s] for r in per_run if s in r])
        if iv.n >= 2:
            steps.append(s)
            mean.append(iv.mean)
            low.append(max(0.0, iv.low))
            high.append(iv.high)
    return steps, mean, low, high


def plot_bands(groups: dict[str, list[str]], out: str, smooth: int = 3) -> dict[str, dict[str, tuple[list, ...]]]:
    """Write the panel figure for ``{label: [run dirs of its seeds]}`` to ``out`` (PNG) and return what was
    drawn: ``{metric: {label: (steps, mean, band low, band high)}}``. On a log panel, steps whose mean is <= 0
    are left out and a lower edge of 0 is drawn at the panel's bottom (the value returned for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn: dict[str, dict[str, tuple[list, ...]]] = {}
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 3.8))
    for ax, (key, title, log) in zip(axes, METRICS):
        drawn[key] = {}
        for i, (label, dirs) in enumerate(groups.items()):
            steps, mean, low, high = band(dirs, key, smooth)
            if log:  # a log axis has no place for 0: those steps are gaps, not a floor value
                keep = [j for j, m in enumerate(mean) if m > 0]
                steps, mean, low, high = ([v[j] for j in keep] for v in (steps, mean, low, high))
            if not steps:
                continue
            ax.plot(steps, mean, color=f"C{i % 10}", label=f"{label} (n={len(dirs)})")
            drawn[key][label] = (steps, mean, low, high)
        ax.set_title(title)
        ax.set_xlabel("step")
        positive = [v for _, m, lo, hi in drawn[key].values() for v in (*m, *lo, *hi) if v > 0]
        bottom = min(positive) / 1.5 if log and positive else 0.0
        for label, (steps, mean, low, high) in drawn[key].items():
            if log:
                low = [v if v > 0 else bottom for v in low]
                drawn[key][label] = (steps, mean, low, high)
            ax.fill_between(steps, low, high, color=f"C{list(groups).index(label) % 10}", alpha=0.2, linewidth=0)
        if log:
            ax.set_yscale("log")
            if positive:
                ax.set_ylim(bottom, max(positive) * 1.5)
        else:
            ax.set_ylim(bottom=0.0)  # non-negative metrics: no negative axis range, even for an all-zero curve
    axes[0].legend(fontsize=7)
    fig.suptitle("mean over seeds, 95% t confidence band, lower edge clipped at 0 (metrics are >= 0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    from slime_tis.cli import run_reporting_errors

    p = argparse.ArgumentParser(prog="python -m examples.plot_bands", description=__doc__)
    p.add_argument("groups", nargs="+", help="LABEL=DIR,DIR,... (the seeds of one variant)")
    p.add_argument("-o", "--out", default="bands.png")
    p.add_argument("--smooth", type=int, default=3)
    args = p.parse_args(argv)

    def run() -> int:
        groups = {}
        for g in args.groups:
            label, _, dirs = g.partition("=")
            if not dirs:
                raise ValueError(f"group must be LABEL=DIR,DIR,..., got {g!r}")
            groups[label] = dirs.split(",")
        plot_bands(groups, args.out, args.smooth)
        return 0

    return run_reporting_errors("examples.plot_bands", run)


if __name__ == "__main__":
    raise SystemExit(main())
