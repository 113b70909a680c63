"""examples.plot (PNG curves of several runs) and examples.compare's table, on hand-written run logs."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
from _one_line_error import assert_one_line_error

from examples.compare import summarize, table
from examples.plot import main as plot_main
from examples.plot import read_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(d, rows, algorithm=None, wall=None):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if algorithm is not None:
        with open(os.path.join(d, "args.json"), "w", encoding="utf-8") as f:
            json.dump({"algorithm": algorithm}, f)
    if wall is not None:
        with open(os.path.join(d, "wall_time.json"), "w", encoding="utf-8") as f:
            json.dump({"wall_s": wall}, f)


def _rows(n, reward0, slope, k3=None, gn=1.0, rej=0.0):
    out = []
    for s in range(n):
        r = {"step": s, "reward": reward0 + slope * s, "grad_norm": gn + 0.1 * s, "loss": -0.01}
        if k3 is not None:
            r.update({"tis/k3_kl": k3 * (s + 1), "tis/kl": 0.001 * s, "tis/rejected_token_fraction": rej})
        out.append(r)
    return out


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot_several_runs_side_by_side(tmp_path, capsys):
    a, b = tmp_path / "lag2-alg0-s0", tmp_path / "lag2-alg2-s0"
    _write_run(a, _rows(10, 0.1, 0.01), algorithm=0)  # no tis/ metrics: skipped panels, not an error
    _write_run(b, _rows(10, 0.1, 0.02, k3=1e-3, rej=0.05), algorithm=2)
    out = tmp_path / "png" / "curves.png"
    assert plot_main([str(a), str(b), "-o", str(out), "--smooth", "3"]) == 0
    width, height = _png_size(out)
    assert width > 1000 and height > 500  # 5 panels on a 3 x 2 grid
    assert "wrote" in capsys.readouterr().out
    assert plot_main([str(a)]) == 0 and os.path.isfile(a / "curves.png")  # default output location


def test_plot_errors_name_the_problem(tmp_path, capsys):
    assert plot_main([str(tmp_path / "nope")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"reward": 1}\n')
    assert plot_main([str(bad)]) == 2
    assert "needs a 'step' field" in capsys.readouterr().err
    _write_run(tmp_path / "ok", _rows(3, 0, 0))
    with pytest.raises(SystemExit):
        plot_main([str(tmp_path / "ok"), "--smooth", "x"])
    assert plot_main([str(tmp_path / "ok"), "--smooth", "0"]) == 2


def test_read_run_keeps_last_row_of_repeated_step(tmp_path):
    _write_run(tmp_path, [{"step": 0, "reward": 0.1}, {"step": 1, "reward": 0.2}, {"step": 1, "reward": 0.3}])
    assert [r["reward"] for r in read_run(str(tmp_path))] == [0.1, 0.3]


def test_compare_summary_and_table(tmp_path):
    longer = tmp_path / "longer"  # 15 steps written out of order: the summary goes by step
    _write_run(longer, _rows(15, 0.1, 0.01, k3=1e-3, rej=0.25)[5:] + _rows(15, 0.1, 0.01)[:5], wall=12.0)
    s = summarize(str(longer))
    assert s["final reward"] == pytest.approx(0.1 + 0.01 * 9.5)  # mean of the last 10 steps (5..14), by step
    assert s["max tis/k3_kl"] == pytest.approx(1.5e-2) and s["max grad norm"] == pytest.approx(2.4)
    d = tmp_path / "lag2-alg2-s0"
    _write_run(d, _rows(10, 0.1, 0.01, k3=1e-3, rej=0.25), wall=12.0)
    s = summarize(str(d))
    assert s["final reward"] == pytest.approx(0.1 + 0.01 * 4.5)  # fewer than 10 steps: all of them
    assert s["max tis/k3_kl"] == pytest.approx(1e-2) and s["max grad norm"] == pytest.approx(1.9)
    assert s["rejected frac"] == pytest.approx(0.25) and s["wall s"] == 12.0
    _write_run(tmp_path / "lag2-alg2-s1", _rows(10, 0.2, 0.01, k3=1e-3), wall=14.0)
    md = table(str(tmp_path), ["lag2"], ["0", "2"], [0, 1])
    lines = md.splitlines()
    assert len(lines) == 3  # header, rule, one row (alg 0 has no runs)
    # two seeds: mean 0.195, s = 0.0707, t_{0.975,1} = 12.706 -> half width 12.706 * 0.0707 / sqrt(2) = 0.635
    # (10 steps: the final reward and the mean over the run are the same numbers here)
    assert lines[2].startswith("| lag2 | 2 | 0.195 ± 0.635 | n/a | 0.195 ± 0.635 | n/a | 5.50e-03 ± ")
    # grad norm: median [min, max] over the seeds, not a t interval; no step above GRAD_SPIKE = 5
    assert "| 1.90 [1.90, 1.90] | 0.0 ± 0.0 |" in lines[2]


def test_compare_table_paired_difference_and_significance(tmp_path):
    """Algorithm 2 beats algorithm 0 by 0.05 +- 0.002 on each of 5 seeds (significant); algorithm 1 differs
    from 0 by +0.1 / -0.1 alternating (mean +0.02, not significant)."""
    for s in range(5):
        base = 0.3 + 0.02 * s  # seed-to-seed spread larger than the paired effect
        _write_run(tmp_path / f"int8-alg0-s{s}", _rows(10, base - 0.07, 0.01, k3=1e-5))
        _write_run(tmp_path / f"int8-alg2-s{s}", _rows(10, base - 0.07 + 0.05 + 0.001 * (s % 2), 0.01, k3=1e-5))
        _write_run(tmp_path / f"int8-alg1-s{s}", _rows(10, base - 0.07 + (0.1 if s % 2 else -0.1) + 0.02, 0.01))
    lines = table(str(tmp_path), ["int8"], ["0", "1", "2"], list(range(5))).splitlines()
    assert "Δ final vs alg 0" in lines[0] and "Δ mean vs alg 0" in lines[0]
    row0, row1, row2 = (line.split(" | ") for line in lines[2:5])
    assert row0[3] == "—" and row0[5] == "—"
    assert row2[3].startswith("+0.050 ± 0.00") and row2[3].endswith(" **")  # paired: the seed spread cancels
    assert row1[3].startswith("+0.000 ± 0.1") and not row1[3].endswith("*")
    # the unpaired intervals of the rewards overlap: only the paired comparison separates alg 2 from alg 0
    assert row0[2].startswith("0.315 ± 0.039") and row2[2].startswith("0.365 ± 0.039")


def test_compare_table_learning_speed_and_grad_spikes(tmp_path):
    """Both variants end at the same reward, algorithm 2 gets there earlier on every seed: the final-reward
    difference is not significant, the mean-over-the-run one is. Algorithm 0 has grad-norm spikes (7 and 1e5)
    on seed 0 only: median [min, max] shows them, the spike count is 2 on one seed of 5."""
    for s in range(5):
        late = [{"step": k, "reward": 0.0 if k < 10 else 1.0, "grad_norm": 1.0} for k in range(30)]
        early = [{"step": k, "reward": 0.0 if k < 5 else 1.0, "grad_norm": 1.0} for k in range(30)]
        if s == 0:
            late[3]["grad_norm"], late[4]["grad_norm"] = 7.0, 1e5
        _write_run(tmp_path / f"fp8-alg0-s{s}", late)
        _write_run(tmp_path / f"fp8-alg2-s{s}", early)
    row0, row2 = (
        line.split(" | ") for line in table(str(tmp_path), ["fp8"], ["0", "2"], list(range(5))).splitlines()[2:]
    )
    assert row2[2] == "1.000 ± 0.000" and row2[3] == "+0.000 ± 0.000"  # same plateau: no difference
    assert row0[4] == "0.667 ± 0.000" and row2[4] == "0.833 ± 0.000"
    assert row2[5] == "+0.167 ± 0.000 **"  # no spread: p = 0, survives Holm over the table's Δ cells
    assert row0[8] == "1.00 [1.00, 100000.00]" and row2[8] == "1.00 [1.00, 1.00]"
    assert row0[9] == "0.4 ± 1.1" and row2[9] == "0.0 ± 0.0"


def test_stats_t_interval_against_hand_values():
    from examples.stats import mean_ci, paired_difference, t975

    assert t975(4) == 2.776 and t975(100) == 1.96
    iv = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0, float("nan")])
    assert iv.n == 5 and iv.mean == 3.0
    assert iv.half == pytest.approx(2.776 * (2.5**0.5) / 5**0.5)
    assert mean_ci([7.0]).n == 1 and mean_ci([]).n == 0
    d = paired_difference({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.5, 1: 1.5, 2: 2.4, 3: 9.0})
    assert d.n == 3 and d.mean == pytest.approx(0.5333333) and d.excludes_zero
    with pytest.raises(ValueError, match="degrees of freedom must be >= 1, got 0"):
        t975(0)


def test_t_p_values_against_the_quantile_table():
    """``t_{0.975, df}`` from the table is where the two-sided p-value is 0.05 (table rounded to 3 decimals:
    p within 1e-4); t = 1 on 1 df (Cauchy) is p = 1/2 exactly; an interval's p is its t-test's."""
    from examples.stats import Interval, mean_ci, t975, t_two_sided_p

    for df in (1, 2, 4, 9, 30):
        assert t_two_sided_p(t975(df), df) == pytest.approx(0.05, abs=1e-4)
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5, abs=1e-12) and t_two_sided_p(0.0, 4) == pytest.approx(1.0)
    assert t_two_sided_p(float("inf"), 3) == 0.0
    # mean 3, s = sqrt(2.5), n = 5: t = 3 / sqrt(0.5) = 4.243 on 4 df -> p = 0.0132 (R: 2 * pt(-4.243, 4))
    assert mean_ci([1.0, 2.0, 3.0, 4.0, 5.0]).p == pytest.approx(0.01324, abs=2e-5)
    assert Interval(0.1, 0.0, 3).p == 0.0 and Interval(0.0, 0.0, 3).p == 1.0 and math.isnan(Interval(1, 1, 1).p)


def test_holm_against_a_hand_worked_example():
    """p = (0.01, 0.04, 0.03, 0.005), m = 4. Sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06;
    0.04 x 1 = 0.04, raised to the running maximum 0.06. At 5 % the first and the fourth survive; the
    uncorrected test would also have kept 0.03 and 0.04."""
    from examples.stats import holm

    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adj = holm([0.2, float("nan"), 0.01])  # nan: not a comparison, m = 2
    assert adj[0] == pytest.approx(0.2) and math.isnan(adj[1]) and adj[2] == pytest.approx(0.02)
    assert holm([0.6, 0.5]) == pytest.approx([1.0, 1.0])  # capped at 1
    with pytest.raises(ValueError, match="p-values must lie in"):
        holm([1.5])


def test_sign_test():
    from examples.stats import sign_test_p

    assert sign_test_p(3, 3) == 0.25 and sign_test_p(0, 6) == pytest.approx(2 / 64)
    assert sign_test_p(10, 14) == pytest.approx(2 * (1 + 14 + 91 + 364 + 1001) / 2**14)  # 0.180
    with pytest.raises(ValueError, match="k=4, n=3"):
        sign_test_p(4, 3)


def test_compare_table_marks_only_holm_survivors_with_two_stars(tmp_path):
    """Three variants against algorithm 0 on 5 seeds: a +0.3 effect with little spread (p ~ 1e-6), and two small
    ones whose intervals just exclude 0 (p ~ 0.03). The table has 6 Δ cells (final and mean reward, equal here):
    Holm multiplies the smallest p by 6, the next by 5, ...: the large effect keeps ``**``, the small ones
    only ``*``."""
    for s in range(5):
        base = 0.3 + 0.05 * s
        _write_run(tmp_path / f"int8-alg0-s{s}", _rows(10, base, 0.0))
        _write_run(tmp_path / f"int8-alg1-s{s}", _rows(10, base + 0.3 + 0.002 * s, 0.0))
        _write_run(tmp_path / f"int8-alg2-s{s}", _rows(10, base + 0.01 + (0.012 if s % 2 else -0.004), 0.0))
        _write_run(tmp_path / f"int8-alg3-s{s}", _rows(10, base + 0.01 + (0.012 if s % 2 else -0.004), 0.0))
    lines = table(str(tmp_path), ["int8"], ["0", "1", "2", "3"], list(range(5))).splitlines()
    row1, row2, row3 = (line.split(" | ") for line in lines[3:6])
    assert row1[3].endswith(" **") and row1[5].endswith(" **")
    for row in (row2, row3):
        assert row[3].endswith(" *") and not row[3].endswith("**")


def test_band_lower_edge_never_below_zero_and_no_log_floor(tmp_path):
    """Grad norms 0.1, 0.1, 2.0 over 3 seeds: the t interval is 0.73 -+ 2.73, below 0 (impossible for a norm):
    the band starts at 0. k3 of a float32 engine is 0 on some steps: on the log panel those steps are gaps,
    the band's zero lower edge sits at the panel's bottom, and no value is the 1e-12 floor."""
    from examples.plot_bands import band, plot_bands

    dirs = []
    for s, gn in enumerate((0.1, 0.1, 2.0)):
        d = tmp_path / f"moe-fp32-alg3-s{s}"
        rows = [{"step": k, "reward": 0.1, "grad_norm": gn, "tis/k3_kl": 0.0 if k < 2 else 1e-6 * (1 + s * k),
                 "tis/rejected_token_fraction": 0.5 if s == 2 else 0.0} for k in range(6)]
        _write_run(d, rows)
        dirs.append(str(d))
    steps, mean, low, high = band(dirs, "grad_norm", smooth=1)
    assert mean[0] == pytest.approx(0.7333333) and low == [0.0] * 6 and high[0] > 3.4
    _, _, rej_low, _ = band(dirs, "tis/rejected_token_fraction", smooth=1)
    assert min(rej_low) == 0.0
    drawn = plot_bands({"fp32": dirs}, str(tmp_path / "bands.png"), smooth=1)
    k3_steps, k3_mean, k3_low, k3_high = drawn["tis/k3_kl"]["fp32"]
    assert k3_steps == [2, 3, 4, 5] and min(k3_mean) > 0  # the all-zero steps 0 and 1 are left out
    assert all(v > 0 and v != 1e-12 for v in k3_low) and max(k3_low) < min(k3_mean)
    for key, groups in drawn.items():
        for _, m, lo, hi in groups.values():
            assert min(lo) >= 0 and 1e-12 not in (*m, *lo, *hi), key


def test_plotted_series_leaves_non_positive_values_out_of_log_panels():
    from examples.plot import plotted_series

    rows = [{"step": k, "tis/k3_kl": v, "reward": v} for k, v in enumerate((0.0, 1e-6, None, -1e-9, 2e-6))]
    assert plotted_series(rows, "tis/k3_kl") == ([1, 4], [1e-6, 2e-6])
    assert plotted_series(rows, "reward") == ([0, 1, 3, 4], [0.0, 1e-6, -1e-9, 2e-6])  # linear panel: kept


def test_compare_plot_titles_compare_png_with_its_seed(tmp_path, monkeypatch):
    """compare.png shows the first seed's runs only: its title says which, and where all seeds are."""
    import examples.plot
    import examples.plot_bands
    from examples.compare import main as compare_main

    seen = []
    monkeypatch.setattr(examples.plot, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(examples.plot_bands, "plot_bands", lambda groups, out: seen.append(groups))
    for s in (3, 4):
        _write_run(tmp_path / f"lag2-alg0-s{s}", _rows(4, 0.1, 0.01))
    assert compare_main(["--table-only", "--plot", "--algs", "0", "--mismatch", "lag2", "--seeds", "3", "4",
                         "--out-dir", str(tmp_path)]) == 0
    argv = seen[0]
    assert argv[argv.index("--title") + 1] == "seed 3 only (bands.png: mean and 95 % band over seeds 3 4)"
    assert seen[1] == {"lag2 alg 0": [str(tmp_path / "lag2-alg0-s3"), str(tmp_path / "lag2-alg0-s4")]}


def test_band_plot_of_several_seeds(tmp_path):
    from examples.plot_bands import band, plot_bands

    dirs = []
    for s in range(3):
        d = tmp_path / f"bf16-alg0-s{s}"
        _write_run(d, _rows(8, 0.1 + 0.01 * s, 0.02, k3=1e-4, rej=0.1))
        dirs.append(str(d))
    steps, mean, low, high = band(dirs, "reward", smooth=1)
    assert steps == list(range(8))
    assert mean[0] == pytest.approx(0.11) and low[0] < 0.11 < high[0]
    assert high[0] - mean[0] == pytest.approx(4.303 * 0.01 / 3**0.5)
    plot_bands({"bf16 alg 0": dirs}, str(tmp_path / "bands.png"))
    w, h = _png_size(tmp_path / "bands.png")
    assert w > 1000 and h > 300


def _results_table_argv(tmp_path, grid, *user_args, env=None):
    """argv that ``examples/results_table.sh`` hands to Python (``PYTHON`` = a script recording its arguments)."""
    import subprocess

    d = tmp_path / grid
    d.mkdir()
    rec, fake = d / "argv.txt", d / "fake_python.sh"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {rec}\n')
    fake.chmod(0o755)
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", "results_table.sh"), *user_args],
        env={**os.environ, "PYTHON": str(fake), "GRID": grid, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, (rec.read_text().splitlines() if rec.exists() else None)


def test_results_table_presets(tmp_path):
    _, main_argv = _results_table_argv(tmp_path, "main")
    assert main_argv[:2] == ["-m", "examples.compare"]
    assert main_argv[main_argv.index("--mismatch") + 1 : main_argv.index("--mismatch") + 5] == [
        "none",
        "int8",
        "fp8",
        "lag2",
    ]
    # docs/results.md's table: 4 optimizer steps per rollout, 80 steps, 2 runs at a time
    assert "--train-args=--steps-per-rollout 2 --ppo-epochs 2" in main_argv
    assert main_argv[main_argv.index("--steps") + 1] == "80" and main_argv[main_argv.index("--jobs") + 1] == "2"

    _, q = _results_table_argv(tmp_path, "quant", "--", "--lr", "1e-3")
    # the model change that makes quantized rollouts matter travels as ONE argument (argparse would read a
    # separate "--hidden-size ..." value as an option)
    assert "--train-args=--hidden-size 256 --steps-per-rollout 2 --ppo-epochs 2" in q
    assert q[q.index("--algs") + 1 : q.index("--mismatch")] == ["0", "2", "2-geo-mis"]
    assert q[q.index("--mismatch") + 1] == "fp8" and q[q.index("--mismatch") + 2].startswith("--train-args=")
    assert q[q.index("--steps") + 1] == "80" and q[q.index("--out-dir") + 1] == "runs/results_quant"
    assert q[-3:] == ["--", "--lr", "1e-3"]  # the user's per-run flags still come last

    from examples.compare import main as compare_main  # the preset's --train-args parses as compare expects

    with pytest.raises(SystemExit) as exit_info:  # --help after the preset exits 0 only if the preset parsed
        compare_main([*q[2 : q.index("--plot")], "--help"])
    assert exit_info.value.code == 0

    proc, argv = _results_table_argv(tmp_path, "bogus")
    assert proc.returncode == 2 and argv is None
    assert "GRID must be 'main', 'quant', 'moe' or 'stale', got 'bogus'" in proc.stderr


def test_results_table_stale_preset_runs_held_out_seeds(tmp_path):
    """GRID=stale: the five variants under lag 2 at lr 1e-2 on the held-out seeds 20-24 (the setting was chosen
    on seeds 10-12), with the stale columns; SEEDS still overrides."""
    _, argv = _results_table_argv(tmp_path, "stale")
    assert argv[argv.index("--algs") + 1 : argv.index("--mismatch")] == ["0", "2", "2-auto", "2-m2po", "2-kpop"]
    assert argv[argv.index("--mismatch") + 1] == "lag2" and argv[argv.index("--columns") + 1] == "stale"
    assert "--train-args=--steps-per-rollout 2 --ppo-epochs 2 --lr 1e-2" in argv
    assert argv[argv.index("--seeds") + 1 : argv.index("--steps")] == ["20", "21", "22", "23", "24"]
    assert argv[argv.index("--steps") + 1] == "40" and argv[argv.index("--out-dir") + 1] == "runs/results_stale"
    (tmp_path / "seeds").mkdir()
    _, argv = _results_table_argv(tmp_path / "seeds", "stale", env={"SEEDS": "7"})
    assert argv[argv.index("--seeds") + 1 : argv.index("--steps")] == ["7"]


@pytest.mark.parametrize("alg", ["2-auto", "2-m2po", "2-kpop"])
def test_stale_table_variants_parse_into_the_example_job(alg):
    """Each variant of the stale table is the example job's own flags, resolved into a plugin configuration of
    algorithm 2 (a flag the job's parser lacks, or a refused combination, fails here, not after minutes)."""
    from examples.compare import ALG_FLAGS
    from examples.rl.train import build_parser
    from slime_tis import TISConfig

    config = TISConfig.from_args(build_parser().parse_args(ALG_FLAGS[alg]))
    assert config.algorithm == 2


def test_compare_stale_columns_ratio_of_k3_and_holm_over_both_metrics(tmp_path):
    """The stale table's k3 column is the geometric-mean ratio to algorithm 0 with its paired 95 % interval.
    3 seeds; per seed k3(alg 2) / k3(alg 0) = 0.5 e^(0, +0.1, -0.1): mean log ratio log 0.5, s = 0.1, half width
    t_{0.975,2} s / sqrt(3) = 4.303 * 0.1 / 1.732 = 0.2484 -> 0.5x [0.5 e^-0.2484, 0.5 e^0.2484] = [0.39x, 0.641x];
    t = log 0.5 / (0.1 / sqrt 3) = -12.0 on 2 df, p = 0.0069. Algorithm 3's ratio is 2x on one seed and 0.5x
    on two (mean log -0.231, wide interval: no star). Rewards equal everywhere (Δ 0, p = 1). The Holm family is
    the 4 comparisons (2 variants x 2 metrics): 4 * 0.0069 = 0.027 <= 0.05, so alg 2's ratio keeps ``**``. An
    arithmetic difference of the k3 means would not be a ratio; a test on it would give another p."""
    per_seed = ((1e-2, 0.5, 2.0), (3e-2, 0.5 * math.exp(0.1), 0.5), (2e-1, 0.5 * math.exp(-0.1), 0.5))
    for s, (a, f2, f3) in enumerate(per_seed):
        _write_run(tmp_path / f"lag2-alg0-s{s}", _rows(10, 0.3, 0.0, k3=a))
        _write_run(tmp_path / f"lag2-alg2-s{s}", _rows(10, 0.3, 0.0, k3=a * f2))
        _write_run(tmp_path / f"lag2-alg3-s{s}", _rows(10, 0.3, 0.0, k3=a * f3))
    lines = table(str(tmp_path), ["lag2"], ["0", "2", "3"], [0, 1, 2], columns="stale").splitlines()
    assert lines[0].split(" | ")[2:6] == [
        "final reward (95% CI)", "Δ final vs alg 0", "mean tis/k3_kl (95% CI)",
        "tis/k3_kl / alg 0: geometric mean [95% CI]",
    ]
    row0, row2, row3 = (line.split(" | ") for line in lines[2:5])
    assert row0[3] == "—" and row0[5] == "—"
    assert row2[3] == "+0.000 ± 0.000" and row2[5] == "0.5x [0.39x, 0.641x] **"
    assert row3[5].startswith("0.794x [") and not row3[5].endswith("*")


# ------------------------------------------------------------------ malformed input to examples.plot
def _one_line_plot_error(capsys, argv: list[str], *needles: str) -> str:
    """``python -m examples.plot ARGV`` fails with exit status 2 and one stderr line holding every needle."""
    return assert_one_line_error(capsys, plot_main, argv, *needles)


PLOT_CASES = {
    "array line": ('[{"step": 1}]', ["metrics.jsonl:2", "must be a JSON object"]),
    "step 1e400": ('{"step": 1e400, "reward": 0.5}', ["metrics.jsonl:2", "'step' must be an integer"]),
    "step string": ('{"step": "abc", "reward": 0.5}', ["metrics.jsonl:2", "'step' must be an integer"]),
    "broken line": ('{"step": 1, "rew', ["metrics.jsonl:2", "not valid JSON"]),
    # values no axis can hold, and values that are no numbers: named, never a crash inside matplotlib
    "400-digit reward": ('{"step": 1, "reward": 1' + "0" * 399 + "}",
                         ["metrics.jsonl:2", "field 'reward' is an integer of 400 digits", "not a metric value"]),
    "5000-digit reward": ('{"step": 1, "reward": 1' + "0" * 4999 + "}", ["metrics.jsonl:2", "not valid JSON"]),
    "reward 1e308": ('{"step": 1, "reward": -1e308}', ["metrics.jsonl:2", "field 'reward' is -1e+308"]),
    "grad_norm 1e301": ('{"step": 1, "grad_norm": 1e301}', ["metrics.jsonl:2", "field 'grad_norm' is 1e+301"]),
    "reward string": ('{"step": 1, "reward": "0.5"}', ["metrics.jsonl:2", "'reward' must be a number or null, got"]),
    "reward true": ('{"step": 1, "reward": true}', ["metrics.jsonl:2", "'reward' must be a number or null, got bool"]),
    "k3 list": ('{"step": 1, "tis/k3_kl": [0.1]}', ["metrics.jsonl:2", "'tis/k3_kl' must be a number or null"]),
}


@pytest.mark.parametrize("case", list(PLOT_CASES))
def test_plot_malformed_metrics(case, tmp_path, capsys):
    line, needles = PLOT_CASES[case]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "reward": 0.1}\n' + line + '\n{"step": 2, "reward": 0.2}\n')
    _one_line_plot_error(capsys, [str(run), "-o", str(tmp_path / "c.png")], *needles)


def test_plot_and_bands_hold_large_values_and_refuse_overflowing_ones(tmp_path, capsys):
    """+-1e300 in one panel is drawn (null, NaN and inf are gaps); 1e308 beside -1e308 is refused in one line
    by the curve plot, the band plot and the comparison table alike."""
    from examples.compare import summarize
    from examples.plot_bands import main as bands_main

    run = tmp_path / "run"
    _write_run(run, [{"step": 0, "reward": -1e300}, {"step": 1, "reward": 1e300}, {"step": 2, "reward": None},
                     {"step": 3, "reward": 0.5, "grad_norm": float("inf")}])
    assert plot_main([str(run), "-o", str(tmp_path / "c.png"), "--smooth", "2"]) == 0
    assert summarize(str(run))["mean reward"] == pytest.approx(0.5 / 3)
    _write_run(run, [{"step": 0, "reward": 1e308}, {"step": 1, "reward": -1e308}])
    _one_line_plot_error(capsys, [str(run), "-o", str(tmp_path / "c.png")], "metrics.jsonl:1", "field 'reward'")
    assert_one_line_error(capsys, bands_main, [f"x={run},{run}", "-o", str(tmp_path / "b.png")],
                          "examples.plot_bands: error:", "metrics.jsonl:1", "field 'reward' is 1e+308")
    with pytest.raises(ValueError, match="metrics.jsonl:1: field 'reward' is 1e"):
        summarize(str(run))


def test_plot_tolerates_torn_last_line_and_odd_args_json(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "reward": 0.1}\n{"step": 1, "reward": 0.2}\n{"step": 2, "re')
    (run / "args.json").write_text("[1, 2]")  # not an object: no label suffix, no crash
    assert plot_main([str(run), "-o", str(tmp_path / "c.png"), "--metrics", "reward"]) == 0
    err = capsys.readouterr().err
    assert "note: " in err and "metrics.jsonl:3: the last line is incomplete" in err
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    _one_line_plot_error(capsys, [str(run)], "is not a run directory")


def test_quickstart_headline_compares_algorithms_and_prints_no_na(tmp_path):
    """The quickstart's closing lines (one mismatch setting, algorithms against algorithm 0): per seed each run's
    final reward, largest grad norm and k3_kl; over seeds how often the final reward is higher and how many runs
    spike; and the quickstart's table has no ``n/a`` cell (every Δ has its algorithm-0 run)."""
    from examples.compare import headline_algs

    for seed, (r0, gn0) in {22: (0.1, 900.0), 23: (0.3, 2.0)}.items():
        _write_run(tmp_path / f"lag2-alg0-s{seed}", _rows(20, r0, 0.0, k3=0.01, gn=gn0), wall=40)
        _write_run(tmp_path / f"lag2-alg2-s{seed}", _rows(20, 0.5, 0.0, k3=0.005, gn=1.0), wall=40)
    text = headline_algs(str(tmp_path), "lag2", ["0", "2"], [22, 23]).splitlines()
    # final reward = mean of the last 10 steps (constant here); max grad norm = gn + 0.1 * 19
    assert text[0] == ("lag2 seed 22: alg 0: final reward 0.10, max grad norm 902, k3_kl 1.05e-01 | "
                       "alg 2: final reward 0.50, max grad norm 2.9, k3_kl 5.25e-02")
    assert text[-1] == ("alg 2 vs alg 0: final reward higher on 2 of 2 seeds; runs with a grad norm > 5: 0 of 2 "
                        "(alg 0: 1 of 2)")
    assert "n/a" not in table(str(tmp_path), ["lag2"], ["0", "2"], [22, 23], "full")


def test_quickstart_prints_a_diagnose_command_that_names_its_own_dump():
    """quickstart.sh's last line is ``<venv bin>/slime-tis diagnose <its algorithm-0 run directory>`` (the venv
    is not active after the script: the path, not a bare ``slime-tis``)."""
    text = open(os.path.join(ROOT, "examples", "quickstart.sh"), encoding="utf-8").read()
    last = [ln for ln in text.splitlines() if ln.strip()][-1]
    assert last == 'echo "${BIN}/slime-tis diagnose ${OUT}/${FIRST_MM}-alg${FIRST_ALG}-s${FIRST_SEED}"'
    assert 'BIN=$(dirname "$VENV_PY")' in text and 'ALGS=${ALGS:-"0 2 2-auto"}' in text
