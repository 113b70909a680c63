"""No collective depends on data: the core under DP=2 x CP=2 (4 real torchrun processes, gloo) with ranks
that see deliberately different data (everything rejected, fully masked, no rollout log-probs in
algorithm 0, a NaN on one rank only; GMPO's sequence mean split over CP) finishes under a timeout, every
rank issues the same collectives (method, op, shape, dtype, in the same order), and the reduced metrics and
the global loss equal one process on the whole batch. See ``uneven_worker.py`` for the data.

Tolerances: the ranks sum float32 values in float64 in another grouping than the single process
(per CP half, then across ranks), so sums agree to ~1e-12 relative; float32 per-token terms (weights,
losses) to ~1e-6 relative: rel 1e-5, abs 1e-6.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _launch import rank_outputs, torchrun

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCENARIOS = ("token_mask_rs_veto_k3_drop", "seq_truncate_rs_batchnorm", "bypass_k3_rs", "alg0_partial_rollout",
             "kpop_logprob_error_veto2_staleness",
             "geo_mean_geo_rs")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven")
    # a data-dependent collective hangs: the launcher's timeout turns that into a failure
    torchrun(HERE / "uneven_worker.py", ["--out", str(out)], nproc=4, timeout=400,
             env={"PYTHONPATH": str(ROOT)}, what="uneven ranks")
    return rank_outputs(out, 4)


@pytest.mark.dist
@pytest.mark.timeout(480)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_uneven_ranks_same_collectives_and_right_metrics(ranks, scenario):
    res = [r[scenario] for r in ranks]
    logs = res[0]["logs"]
    assert logs[0], "no collective was issued"
    for other in logs[1:]:
        assert other == logs[0], "ranks issued different collectives"
    ref = res[0]["ref"]
    for rank, r in enumerate(res):
        assert set(r["metrics"]) == set(res[0]["metrics"])
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), rank
        got = {k: v for k, v in r["metrics"].items() if k in ref}
        assert set(ref) - {"loss"} <= set(got), set(ref) - set(got)
        for k, v in got.items():
            assert math.isfinite(v), (rank, k)
            assert v == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (rank, k, v, ref[k])
    m = res[0]["metrics"]
    if scenario != "alg0_partial_rollout":
        assert res[0]["all_rejected_here"] and res[1]["all_rejected_here"]
        assert m["tis/rejected_seq_fraction"] > 0.4  # DP rank 0's sequences are all rejected
    assert m.get("tis/nonfinite_seq_fraction", m.get("policy/nonfinite_seq_fraction")) > 0
    assert m["policy/nonfinite_seq_fraction"] > 0  # the NaN on rank 2 reaches every rank's metrics
    if scenario == "kpop_logprob_error_veto2_staleness":  # every bucket and rule reported, DP rank 0 all rejected
        assert {f"tis/staleness_{b}/k3_kl" for b in ("0", "1", "2plus")} <= set(m)
        assert m["tis/veto_upper_seq_fraction"] > 0.4 and m["tis/binary_kl_fraction"] > 0.4
        assert m["tis/staleness_invalid_seq_fraction"] == pytest.approx(1 / 10)  # of the 10 sequences
