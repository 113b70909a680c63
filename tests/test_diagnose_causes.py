"""``slime-tis diagnose``'s mismatch by cause (``slime_tis.tools.causes``) on a dump of known composition: each
cause's perturbation is injected on its own tokens, so its true share of ``k3_kl`` is known exactly (the k3 it
adds over the same tokens without it); the report recovers each within 10 %."""

from __future__ import annotations

import math

import pytest
import torch

from slime_tis.cli import main as cli_main
from slime_tis.tools.causes import mismatch_by_cause
from slime_tis.tools.dump import read_logprob_dump, write_logprob_dump


def _k3(x: torch.Tensor) -> float:
    return float((torch.expm1(x) - x).sum())


def composed_dump(seed: int = 0, n_seq: int = 400, length: int = 50):
    """Records and the true shares. Every token has numeric noise ``e ~ N(0, 0.1^2)``; stale sequences (every
    4th, staleness 2) add ``N(0, 0.25^2)`` to each token; in fresh sequences, 8 % of the tokens were re-routed
    (``N(0, 0.6^2)`` added) and 20 % of the others were sampled from a truncated support (``log S`` of a kept
    mass ``S ~ U(0.6, 0.95)``: the rollout's log-prob is over the support, so ``lr = e + log S``)."""
    g = torch.Generator().manual_seed(seed)
    recs, base_all, full_all = [], [], []
    for i in range(n_seq):
        e = 0.1 * torch.randn(length, generator=g, dtype=torch.float64)
        lr, mass = e.clone(), torch.zeros(length, dtype=torch.float64)
        routed = torch.zeros(length, dtype=torch.bool)
        stale = 2.0 if i % 4 == 0 else 0.0
        if stale:
            lr = lr + 0.25 * torch.randn(length, generator=g, dtype=torch.float64)
        else:
            routed = torch.rand(length, generator=g) < 0.08
            lr = torch.where(routed, lr + 0.6 * torch.randn(length, generator=g, dtype=torch.float64), lr)
            trunc = ~routed & (torch.rand(length, generator=g) < 0.2)
            s = 0.6 + 0.35 * torch.rand(length, generator=g, dtype=torch.float64)
            mass = torch.where(trunc, s.log(), mass)
            lr = lr + mass
        train = -1.0 - torch.rand(length, generator=g, dtype=torch.float64)
        recs.append({"train_log_probs": train.float(), "rollout_log_probs": (train - lr).float(),
                     "rollout_log_mass": mass.float(), "routing_differs": routed.int(), "staleness": stale})
        base_all.append((e, mass != 0, routed, torch.full((length,), bool(stale))))
        full_all.append(lr)
    full = torch.cat(full_all)
    e = torch.cat([b[0] for b in base_all])
    trunc, routed, stale = (torch.cat([b[k] for b in base_all]) for k in (1, 2, 3))
    total = _k3(full)
    truth = {
        "truncated sampling": (_k3(full[trunc]) - _k3(e[trunc])) / total,
        "MoE routing": (_k3(full[routed]) - _k3(e[routed])) / total,
        "staleness": (_k3(full[stale]) - _k3(e[stale])) / total,
    }
    truth["remainder"] = 1.0 - sum(truth.values())
    return recs, truth


def test_each_share_recovered_within_10_percent(tmp_path):
    recs, truth = composed_dump()
    assert min(truth.values()) > 0.05  # every cause matters in this composition
    path = tmp_path / "d.jsonl"
    write_logprob_dump(path, recs)
    got = mismatch_by_cause(read_logprob_dump(path))
    for cause, share in truth.items():
        assert got["shares"][cause] == pytest.approx(share, rel=0.10), (cause, got["shares"], truth)
    assert got["shares"]["routing and staleness"] == 0.0  # no token has both here
    # the same through the .pt format, and the report's lines
    write_logprob_dump(tmp_path / "d.pt", recs)
    again = mismatch_by_cause(read_logprob_dump(tmp_path / "d.pt"))
    assert again["shares"] == pytest.approx(got["shares"], rel=1e-5, abs=1e-7)
    assert cli_main(["diagnose", str(path), "--no-png"]) == 0


def test_a_cause_the_dump_does_not_record_is_said_so(tmp_path, capsys):
    recs, _ = composed_dump(n_seq=40)
    for r in recs:
        del r["routing_differs"]
    write_logprob_dump(tmp_path / "d.jsonl", recs)
    got = mismatch_by_cause(read_logprob_dump(tmp_path / "d.jsonl"))
    assert got["shares"]["MoE routing"] is None and got["shares"]["routing and staleness"] is None
    assert math.isfinite(got["shares"]["remainder"])
    assert cli_main(["diagnose", str(tmp_path / "d.jsonl"), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "mismatch by cause" in out and "MoE routing              not recorded in the dump" in out
    # a dump with none of the causes has no such section
    for r in recs:
        del r["rollout_log_mass"], r["staleness"]
    write_logprob_dump(tmp_path / "e.jsonl", recs)
    assert mismatch_by_cause(read_logprob_dump(tmp_path / "e.jsonl")) is None


def test_malformed_cause_fields_are_one_line_errors(tmp_path, capsys):
    rec = {"train_log_probs": [-1.0, -2.0], "rollout_log_probs": [-1.1, -2.0]}
    for bad, words in (({"routing_differs": [0, 2]}, "routing_differs[1] must be 0 or 1"),
                       ({"routing_differs": [1]}, "routing_differs has 1 entries but train_log_probs has 2"),
                       ({"staleness": -1}, "staleness = -1.0")):
        path = tmp_path / "bad.jsonl"
        path.write_text('{"format": "slime_tis.logprob_dump", "version": 1}\n'
                        + __import__("json").dumps({**rec, **bad}) + "\n")
        assert cli_main(["diagnose", str(path), "--no-png"]) == 2
        assert words in capsys.readouterr().err
