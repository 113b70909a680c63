"""The global searches (``core.search``: M2PO's cut, ``--tis-upper-bound auto``) under DP=2 x CP=2 in 4 real torchrun
processes (gloo), with rank 0 holding every large ratio of the batch (``search_worker.py``): the searched values, the
metrics and the global loss equal one process on the whole batch, and every rank issues the same collectives
(reducer log and a census of ``torch.distributed.all_reduce`` calls) on the uneven data as on even data.

Tolerances: the ranks sum in another grouping than the single process; the searches' sums are float64 (~1e-15
relative), so a bisection step could only go the other way where a predicate sits within ~1e-15 of its boundary:
the searched values agree to float32 rounding. Losses and float32 per-token terms: rel 1e-5, abs 1e-6 (as
test_uneven_ranks.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _launch import rank_outputs, torchrun

from slime_tis.core.search import SEARCH_STEPS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCENARIOS = ("alg2_token_auto_m2po_drop_bn", "alg2_sequence_auto", "alg3_token_auto_m2po",
             "alg2_prefix_min_mask_zigzag", "alg3_prefix_auto_zigzag")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    torchrun(HERE / "search_worker.py", ["--out", str(out)], nproc=4, timeout=240,
             env={"PYTHONPATH": str(ROOT)}, what="global search")
    return rank_outputs(out, 4)


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_search_matches_one_process_and_collectives_ignore_the_data(ranks, scenario):
    res = [r[scenario] for r in ranks]
    ref = res[0]["ref"]
    first = res[0]["uneven"]
    searches = sum(k in scenario for k in ("auto", "m2po"))
    steps = sum(1 for name, *_ in first["log"] if name == "batch_sum")
    assert steps >= searches * SEARCH_STEPS * (2 if scenario.startswith("alg3") or "zigzag" in scenario else 1)
    for rank, r in enumerate(res):
        # the same collectives on every rank, and on even data as on the uneven data
        assert r["uneven"]["log"] == first["log"], rank
        assert r["even"]["log"] == first["log"], rank
        assert r["even"]["census"] == r["uneven"]["census"] == first["census"], rank
        assert len(r["uneven"]["census"]) == len(first["log"])  # every all-reduce went through the reducer
        got = r["uneven"]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), rank
        assert set(got["metrics"]) == set(ref["metrics"])
        for k, v in ref["metrics"].items():
            assert math.isfinite(got["metrics"][k]), (rank, k)
            assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (rank, k, got["metrics"][k], v)
    m = first["metrics"]
    if "auto" in scenario:  # the bound binds and reaches the target ESS
        target = {"alg2_sequence_auto": 0.5, "alg3_prefix_auto_zigzag": 0.6}.get(scenario, 0.99)
        assert m["tis/truncate_fraction"] > 0
        assert 1.0 < m["tis/auto_upper_bound"] < 100.0
        if scenario.startswith("alg2"):  # one search over the step (alg 3: one per micro-batch, whose union's ESS
            assert m["tis/ess"] >= target - 1e-6  # may fall below the target: ESS is not additive)
    if "prefix_min_mask" in scenario:  # rank 0's large first halves: rejected while their prefix minimum stays above
        assert 0.05 < m["tis/mask_fraction_high"] < 0.9  # the upper bound; the tokens after them on rank 1 are kept
    if "m2po" in scenario:  # rank 0's large ratios are cut, the rest kept
        assert 0.1 < m["tis/m2po_fraction"] < 0.6
        assert m["tis/log_ratio_sq_cut"] >= 0.04
