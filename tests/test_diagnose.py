"""``slime-tis diagnose``: numbers against the core and against plain-torch formulas, the recommendation
rules, and the console script end to end on a dump written by the example job."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_tis import TISConfig, compute_tis
from slime_tis.cli import main as cli_main
from slime_tis.tools.diagnose import PERCENTILES, diagnose, write_histogram
from slime_tis.tools.dump import read_logprob_dump, write_logprob_dump

ROOT = Path(__file__).resolve().parents[1]


def synthetic(seed: int = 0, *, n: int = 60, noise: float = 0.05, lengths=(5, 300), catastrophic: bool = False,
              nan_seq: bool = True) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    recs = []
    for i in range(n):
        r = int(torch.randint(lengths[0], lengths[1], (1,), generator=g))
        lt = -torch.rand(r, generator=g) * 2
        lr = lt + noise * torch.randn(r, generator=g)
        mask = torch.ones(r)
        mask[: min(2, r - 1)] = 0  # a couple of tool tokens
        lr[0] = float("nan")  # masked NaN: ignored
        if catastrophic and i == 1:
            lr[-1] = lt[-1] + 11.0
        if nan_seq and i == 2:
            lt[-1] = float("nan")  # valid NaN: sequence excluded and counted
        recs.append({"train_log_probs": lt, "rollout_log_probs": lr, "loss_mask": mask, "step": i % 3})
    return recs


def dump_of(recs, tmp_path, name="d.jsonl"):
    path = tmp_path / name
    write_logprob_dump(path, recs)
    return read_logprob_dump(path)


def plain_log_ratios(dump):
    """Independent of the core: valid tokens of sequences without non-finite valid values."""
    toks, sums, geos, mins = [], [], [], []
    cu = dump.cu_seqlens.tolist()
    for i in range(dump.n_seq):
        a, b = cu[i], cu[i + 1]
        m = dump.loss_mask[a:b]
        l = (dump.train_log_probs[a:b] - dump.rollout_log_probs[a:b])[m]  # noqa: E741
        if l.numel() == 0 or not torch.isfinite(l).all():
            continue
        toks.append(l)
        sums.append(l.sum())
        geos.append(l.mean())
        mins.append(l.min())
    return torch.cat(toks), torch.stack(sums), torch.stack(geos), torch.stack(mins)


def test_numbers_match_core_and_plain_formulas(tmp_path):
    dump = dump_of(synthetic(0), tmp_path)
    cfg = TISConfig(use_tis=True, mode="clip", level="sequence", upper=3.0)
    d = diagnose(dump, cfg, bucket_edges=[64, 160])
    ref = {k: float(v) for k, v in compute_tis(cfg, dump.train_log_probs, dump.rollout_log_probs, dump.loss_mask,
                                                 dump.cu_seqlens).stats.finalize().items()}
    assert d.overall == pytest.approx(ref, rel=1e-9, abs=1e-12)
    assert d.overall["tis/nonfinite_seq_fraction"] == pytest.approx(1 / 60)

    tok, sums, geos, mins = plain_log_ratios(dump)
    q = torch.tensor(PERCENTILES, dtype=torch.float64) / 100
    for name, x in (("token log-ratio", tok), ("sequence log-ratio", sums), ("geometric log-ratio", geos),
                    ("min token log-ratio", mins)):
        assert d.percentiles[name] == pytest.approx(torch.quantile(x.double(), q).tolist(), rel=1e-5, abs=1e-6)
    assert d.percentiles["token ratio"][-1] == pytest.approx(math.exp(float(tok.max())), rel=1e-5)
    # overall kl against the plain formula: mean over valid tokens of finite sequences of lp_rollout - lp_train
    assert d.overall["tis/kl"] == pytest.approx(float(-tok.double().mean()), rel=1e-5)

    # buckets: edges 1-63, 64-159, 160+; each bucket's numbers = the core on that sub-dump
    assert [(b["len_lo"], b["len_hi"]) for b in d.buckets] == [(1, 63), (64, 159), (160, int(dump.valid_lengths.max()))]
    assert sum(b["n_seq"] for b in d.buckets) == 60
    vl = dump.valid_lengths
    for b in d.buckets:
        sub = dump.select((vl >= b["len_lo"]) & (vl <= b["len_hi"]))
        res = compute_tis(TISConfig(use_tis=True), sub.train_log_probs, sub.rollout_log_probs, sub.loss_mask,
                          sub.cu_seqlens).stats.finalize()
        assert b["kl"] == pytest.approx(float(res["tis/kl"]), rel=1e-9, abs=1e-12)
        assert b["k3_kl"] == pytest.approx(float(res["tis/k3_kl"]), rel=1e-9, abs=1e-12)
        assert b["chi2_seq"] == pytest.approx(float(res["tis/chi2_seq"]), rel=1e-9, abs=1e-12)
        _, s_sums, s_geos, _ = plain_log_ratios(sub)
        assert b["out_sequence"] == pytest.approx(float(((s_sums < math.log(0.5)) | (s_sums > math.log(2))).double()
                                                        .mean()))
        assert b["out_geometric"] == pytest.approx(float(((s_geos < -math.log(1.001)) | (s_geos > math.log(1.001)))
                                                         .double().mean()))


def test_recommendation_negligible_mismatch(tmp_path):
    d = diagnose(dump_of(synthetic(1, noise=1e-4, nan_seq=False), tmp_path))
    assert d.recommendation.fields == {"mode": "truncate", "level": "token", "upper": 2.0}
    assert "negligible mismatch" in d.recommendation.reasons[0]


def test_recommendation_length_trap_goes_geometric_with_veto(tmp_path):
    d = diagnose(dump_of(synthetic(2, noise=0.08, lengths=(200, 400), catastrophic=True), tmp_path))
    f = d.recommendation.fields
    assert f["mode"] == "mask" and f["level"] == "geometric" and f["upper"] >= 1.001
    assert f["veto_threshold"] == 1e-4
    assert "sequence-level weights saturate" in d.recommendation.reasons[0]
    assert any("catastrophic token" in r for r in d.recommendation.reasons)
    assert any("non-finite" in r for r in d.recommendation.reasons)
    # about 10% of the (finite) sequences rejected by the geometric bound, as the reason says
    assert 0.05 <= d.recommendation.metrics["tis/mask_fraction_low"] + d.recommendation.metrics[
        "tis/mask_fraction_high"] <= 0.2
    assert "--tis-mode mask --tis-level geometric" in d.recommendation.flags


def test_recommendation_as_slime_yaml_keys_and_what_the_given_config_does(tmp_path, capsys):
    """--format yaml prints the recommendation as slime takes it (its --use-tis flag and the YAML keys, each
    the flag's argparse dest, which TISConfig.from_args reads back to the same fields); the report says what the
    configuration given would do to the dump (here: the veto and the mask fire)."""
    import argparse

    import yaml

    from slime_tis.arguments import add_tis_arguments

    dump = dump_of(synthetic(2, noise=0.08, lengths=(200, 400), catastrophic=True), tmp_path)
    rec = diagnose(dump).recommendation
    text = rec.yaml
    assert text.startswith("slime flag: --use-tis\n  slime --custom-config-path YAML:\n")
    keys = yaml.safe_load(text.split("YAML:\n", 1)[1])
    ns = add_tis_arguments(argparse.ArgumentParser()).parse_args(["--use-tis"])
    for k, v in keys.items():
        setattr(ns, k, v)
    cfg = TISConfig.from_args(ns)
    assert {f: getattr(cfg, f) for f in rec.fields} == pytest.approx(rec.fields)
    assert cli_main(["diagnose", str(tmp_path / "d.jsonl"), "--no-png", "--format", "yaml", "--use-tis",
                     "--tis-veto-threshold", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert "    tis_mode: mask\n" in out and "--tis-mode mask" not in out.split("recommendation:")[1].split("\n")[1]
    acts = out.split("what this configuration would do to the dump:\n")[1].split("\n\n")[0]
    assert "sequences vetoed" in acts and "rejects " in acts


def test_recommendation_short_sequences_sequence_level(tmp_path):
    d = diagnose(dump_of(synthetic(3, noise=0.05, lengths=(4, 12), nan_seq=False), tmp_path))
    assert d.recommendation.fields == {"mode": "truncate", "level": "sequence", "upper": 2.0}


def test_histogram_png(tmp_path):
    dump = dump_of(synthetic(4), tmp_path)
    n = write_histogram(dump, str(tmp_path / "h.png"))
    tok, *_ = plain_log_ratios(dump)
    assert n == tok.numel()
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """A 2-step run of the example job (algorithm 2, rollouts 1 step stale), which writes RUN_DIR/logprobs.jsonl
    every step."""
    run = tmp_path_factory.mktemp("example_run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "examples.rl.train", "--run-dir", str(run), "--steps", "2", "--prompts-per-step",
           "8", "--group-size", "4", "--dump-interval", "1", "--use-tis", "--no-progress", "--rollout-logit-noise",
           "0.3", "--rollout-lag", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_on_example_job_dump(example_run, tmp_path, capsys):
    dump_path = example_run / "logprobs.jsonl"
    png, js = tmp_path / "hist.png", tmp_path / "report.json"
    assert cli_main(["diagnose", str(dump_path), "--png", str(png), "--json", str(js), "--tis-level",
                     "geometric", "--tis-mode", "mask", "--use-tis"]) == 0
    out = capsys.readouterr().out
    for header in ("overall (core metrics", "percentiles", "by response length", "recommendation:", "--use-tis"):
        assert header in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(js.read_text())
    dump = read_logprob_dump(dump_path)
    assert report["n_seq"] == dump.n_seq == 2 * 8 * 4
    # the engine serves step 0 the current weights and step 1 those of one step before: staleness 0, then 1
    assert dump.staleness.tolist() == [0.0] * 32 + [1.0] * 32
    assert report["causes"]["tokens_of"]["staleness"] > 0 and "mismatch by cause" in out
    cfg = TISConfig(use_tis=True, mode="mask", level="geometric")
    ref = compute_tis(cfg, dump.train_log_probs, dump.rollout_log_probs, dump.loss_mask, dump.cu_seqlens)
    for k, v in ref.stats.finalize().items():
        assert report["overall"][k] == pytest.approx(float(v), rel=1e-9, abs=1e-12), k
    # --steps keeps one step
    assert cli_main(["diagnose", str(dump_path), "--no-png", "--steps", "1:", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["n_seq"] == 32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_plot_reads_the_example_job_run(example_run, tmp_path, capsys):
    from examples.plot import main as plot_main

    out = tmp_path / "curves.png"
    assert plot_main([str(example_run), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors(tmp_path, capsys):
    assert cli_main(["diagnose", str(tmp_path / "missing.jsonl"), "--no-png"]) == 2
    assert "dump file not found" in capsys.readouterr().err
    assert cli_main(["diagnose", str(tmp_path / "x.csv"), "--no-png"]) == 2
    assert "must end in .jsonl or .pt" in capsys.readouterr().err
    write_logprob_dump(tmp_path / "d.jsonl", synthetic(5, n=4))
    assert cli_main(["diagnose", str(tmp_path / "d.jsonl"), "--no-png", "--steps", "x"]) == 2
    assert "--steps = 'x'" in capsys.readouterr().err
    assert cli_main(["diagnose", str(tmp_path / "d.jsonl"), "--no-png", "--steps", "50:"]) == 2
    assert "selects no sequence" in capsys.readouterr().err
    assert cli_main([]) == 2


def test_cli_reads_a_run_directory(tmp_path, capsys):
    """A directory stands for its dump: ``RUN_DIR/logprobs.jsonl`` (the example job's run directory, next to
    its ``metrics.jsonl``), with the report of that file and the histogram beside it; a directory holding no
    dump is one line naming it and what was looked for."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "reward": 0.5}\n')  # not a dump: never read as one
    write_logprob_dump(run / "logprobs.jsonl", synthetic(3, n=12))
    by_file, by_dir = tmp_path / "file.json", tmp_path / "dir.json"
    assert cli_main(["diagnose", str(run / "logprobs.jsonl"), "--no-png", "--json", str(by_file)]) == 0
    assert cli_main(["diagnose", str(run), "--json", str(by_dir)]) == 0
    assert json.loads(by_dir.read_text()) == json.loads(by_file.read_text())
    assert "recommendation:" in capsys.readouterr().out
    assert (run / "logprobs_logratio_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 0}\n')
    assert cli_main(["diagnose", str(empty), "--no-png"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(empty) in err[0]
    assert "is a directory holding no log-prob dump" in err[0] and "logprobs.jsonl" in err[0] and "train_*.pt" in err[0]


def test_help_says_the_flags_are_a_configuration_to_evaluate_in_plain_text(capsys):
    """``slime-tis diagnose --help``: the training flags are a hypothetical configuration (not the dump's run), the
    default applies to any dump, and the text is plain (no reST markup)."""
    with pytest.raises(SystemExit):
        cli_main(["diagnose", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "hypothetical correction configuration" in out
    assert "algorithm 2 with token-level truncation at 2, whatever algorithm wrote the dump" in out
    assert "algorithm-0 dump" in out
    assert "``" not in out and ":func:" not in out
