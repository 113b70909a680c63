"""``slime-tis diagnose`` on a dump that carries the rollout's kept mass (``rollout_log_mass``): the dump field
round-trips (.jsonl and .pt), and the report says how much of the mismatch the sampled support explains."""

from __future__ import annotations

import pytest
import torch

from slime_tis.tools.diagnose import diagnose, format_report, support_explained
from slime_tis.tools.dump import read_logprob_dump, write_logprob_dump


def _records(replayed: bool, n_seq: int = 40, length: int = 6, seed: int = 0):
    """Sequences whose rollout sampled from the top-p cut of the trainer's own policy: per token kept mass S in
    (0.6, 1), pi_rollout = q = p / S, and the trainer's log-prob p (full) or q (replay), plus small noise."""
    g = torch.Generator().manual_seed(seed)
    recs = []
    for _ in range(n_seq):
        log_p = -torch.rand(length, generator=g) * 3
        log_s = torch.log(0.6 + 0.4 * torch.rand(length, generator=g))
        rollout = log_p - log_s
        noise = 1e-3 * torch.randn(length, generator=g)
        train = (rollout if replayed else log_p) + noise
        recs.append({"train_log_probs": train.tolist(), "rollout_log_probs": rollout.tolist(),
                     "rollout_log_mass": log_s.tolist()})
    return recs


@pytest.mark.parametrize("suffix", [".jsonl", ".pt"])
def test_the_field_round_trips(tmp_path, suffix):
    recs = _records(False, n_seq=3)
    path = tmp_path / f"d{suffix}"
    write_logprob_dump(path, recs, meta={"sampling_support": "full"})
    dump = read_logprob_dump(path)
    assert dump.rollout_log_mass is not None and dump.meta["sampling_support"] == "full"
    assert dump.rollout_log_mass.tolist() == pytest.approx([v for r in recs for v in r["rollout_log_mass"]])
    assert dump.select(torch.tensor([False, True, False])).rollout_log_mass.numel() == 6
    bad = [dict(recs[0], rollout_log_mass=recs[0]["rollout_log_mass"][:-1])]
    with pytest.raises(ValueError, match="record 0: rollout_log_mass has 5 entries but train_log_probs has 6"):
        write_logprob_dump(tmp_path / "bad.jsonl", bad)


@pytest.mark.parametrize("replayed", [False, True])
def test_the_report_says_what_the_support_explains(tmp_path, replayed):
    path = tmp_path / "d.jsonl"
    write_logprob_dump(path, _records(replayed), meta={"sampling_support": "replay" if replayed else "full"})
    d = diagnose(read_logprob_dump(path))
    s = d.support
    assert s is not None and s["tokens"] == 240
    # full vocabulary: the ratio is the kept mass, token by token; over the support: 1 up to the noise
    assert s["full_ratio_mean"] == pytest.approx(s["kept_mass_mean"], abs=2e-3)
    assert s["replay_ratio_mean"] == pytest.approx(1.0, abs=1e-3) and s["replay_outside_10pct"] == 0.0
    assert s["full_outside_10pct"] > 0.3 and s["explained"] > 0.99
    text = format_report(d)
    assert "sampling support (top-p / top-k" in text and "the support explains" in text
    assert ("replay removes it" in text) != replayed
    assert d.as_dict()["support"] == s


def test_no_field_no_section():
    recs = [{k: v for k, v in r.items() if k != "rollout_log_mass"} for r in _records(False, n_seq=2)]
    d = diagnose(_dump_of(recs))
    assert d.support is None and "sampling support" not in format_report(d)
    assert support_explained(_dump_of(recs)) is None


def _dump_of(recs):
    from slime_tis.tools.dump import _normalise, _pack

    return _pack([_normalise(r, i) for i, r in enumerate(recs)], {})
