"""The megatron hook in real ``torchrun`` processes (gloo, CPU) against a single-process oracle.

Each plan is one ``torchrun`` launch of ``megatron_worker.py`` (the ~3 s megatron import is paid once);
every check in it becomes one test item here. A check runs one optimizer step of a tiny megatron-core
GPT (local layer spec, megatron DDP, ``get_forward_backward_func``) through
``tis_forward_backward_func`` under a parallel layout and compares, on every rank, with an oracle that
runs the same weights and global batch as one process with plain autograd and one core ``policy_loss``
call:

* every parameter gradient (this rank's TP/PP shard) to 1e-5 relative (max-abs error / max-abs value);
* the global loss (``last_metrics["loss"]``) and the loss Megatron-LM's ``train_step`` would log from the
  schedule's loss dicts (``tests/_megatron_lm.py``: ``[value, count]`` summed over micro-batches and
  all-reduced over DP x CP) to 1e-5 relative, on every last-stage rank;
* every finalized ``tis/`` and ``policy/`` metric (true MIN / MAX across ranks included), in ``last_metrics``
  and as ``train_step`` would log it from the loss dicts.

Several optimizer steps per rollout (``_rollout_harness.py``): two steps on one rollout with pi_old computed
once (``compute_old_log_probs``), the clip active in step 2; loss, gradients and clip fraction equal a hand
computation of the clipped PPO loss (algorithms 0 and 2), in one process, under PP=2 and under DP=2.

Controls run the same checks with a deliberately broken reducer and must disagree with the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from _launch import torchrun  # noqa: E402
from _plans import NPROC, check_id, plan_checks  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-5
LAUNCH_TIMEOUT_S = 420


def _launch(plan: str, out: Path) -> list[dict]:
    """Run one torchrun launch; kill its whole process group on timeout (a hang fails, never blocks)."""
    torchrun(HERE / "megatron_worker.py", ["--out", str(out), "--plan", plan], nproc=NPROC[plan],
             timeout=LAUNCH_TIMEOUT_S, what=f"torchrun plan {plan}")
    results = []
    for f in sorted(out.glob("rank*.jsonl")):
        results += [json.loads(line) for line in f.read_text().splitlines()]
    assert len(results) == NPROC[plan] * len(plan_checks(plan)), "missing results from some rank"
    return results


_CACHE: dict[str, list[dict]] = {}


def _results(plan: str, tmp_path_factory) -> list[dict]:
    if plan not in _CACHE:
        _CACHE[plan] = _launch(plan, tmp_path_factory.mktemp(f"megatron_{plan}"))
    return _CACHE[plan]


def _of(results: list[dict], check: dict) -> list[dict]:
    rows = [r for r in results if (r["layout"], r["case"], r["M"], r.get("tag", "")) ==
            (check["layout"], check["case"], check["M"], check.get("tag", ""))]
    for r in rows:
        assert "error" not in r, f"rank {r['rank']} raised:\n{r['error']}"
    return rows


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-6)


def _metric_close(a: float, b: float) -> bool:
    # float32 sums of ~100 terms (and std = sqrt(E[x^2] - E[x]^2)): absolute floor 1e-4
    return abs(a - b) <= 1e-4 + 1e-5 * abs(b)


def _assert_matches_oracle(rows: list[dict]) -> None:
    for r in rows:
        assert r["finite"], f"rank {r['rank']}: non-finite gradient"
        assert r["n_params"] > 0
        assert r["grad_err"] <= GRAD_RTOL, (
            f"rank {r['rank']}: grad of {r['grad_err_param']} off by {r['grad_err']:.2e} relative")
    last = [r for r in rows if r["last_stage"]]
    assert last, "no last-stage rank reported"
    for r in last:
        assert _rel(r["loss"], r["oracle_loss"]) <= LOSS_RTOL, (r["loss"], r["oracle_loss"])
        assert _rel(r["logged_loss"], r["oracle_loss"]) <= LOSS_RTOL, (r["logged_loss"], r["oracle_loss"])
        assert not r["missing_metrics"], f"metrics missing from the hook: {r['missing_metrics']}"
        bad = {k: (r["metrics"][k], v) for k, v in r["oracle_metrics"].items()
               if not _metric_close(r["metrics"][k], v)}
        assert not bad, f"rank {r['rank']}: metrics differ from the oracle (hook, oracle): {bad}"
        logged = {k: (r["logged_metrics"].get(k), v) for k, v in r["oracle_metrics"].items()
                  if k != "loss" and (k not in r["logged_metrics"] or not _metric_close(r["logged_metrics"][k], v))}
        assert not logged, f"rank {r['rank']}: metrics Megatron-LM would log differ (logged, oracle): {logged}"


MAIN2 = [c for c in plan_checks("main2") if not c.get("reducer") and not c.get("kind") and not c.get("opaque")
         and c.get("no_rollout_dp_rank") is None]
CONTROLS = [c for c in plan_checks("main2") if c.get("reducer")]
ROLLOUT2 = [c for c in plan_checks("main2") if c.get("kind")]
ONE = [c for c in plan_checks("one") if c.get("kind") in ("rollout", "supplied")]
MAIN4 = plan_checks("main4")
REGISTRY = plan_checks("registry")


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", MAIN2, ids=check_id)
def test_two_processes_match_single_process(check, tmp_path_factory):
    """PP=2, TP=2, CP=2, DP=2 (both loss forms), algorithms 0-3, M = 1 and 4, masked data, the patch."""
    _assert_matches_oracle(_of(_results("main2", tmp_path_factory), check))


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", MAIN4, ids=check_id)
def test_four_processes_match_single_process(check, tmp_path_factory):
    """TP2 x PP2 and DP2 x CP2 on 4 processes."""
    _assert_matches_oracle(_of(_results("main4", tmp_path_factory), check))


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", REGISTRY, ids=check_id)
def test_policy_loss_registry_matches_single_process(check, tmp_path_factory):
    """GSPO (its sequence ratio completed over CP), CISPO, on_policy, token-sum and the reference-KL / entropy
    terms, composed with weights, rejection and drop, under DP=2, CP=2 and PP=2: loss, gradients and metrics
    equal one process's whole-batch ``policy_loss``."""
    _assert_matches_oracle(_of(_results("registry", tmp_path_factory), check))


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", [c for c in CONTROLS if c["reducer"] == "nocp"], ids=check_id)
def test_sequence_level_needs_the_cp_reduction(check, tmp_path_factory):
    """Sequence/geometric IS under CP=2 equals CP=1 (main checks) only thanks to the CP sequence_sum:
    with per-rank (unreduced) sums the loss and gradients differ from the oracle."""
    results = _results("main2", tmp_path_factory)
    broken = _of(results, check)
    assert max(r["grad_err"] for r in broken) > 1e-2
    assert max(_rel(r["loss"], r["oracle_loss"]) for r in broken if r["last_stage"]) > 1e-3
    _assert_matches_oracle(_of(results, {**check, "M": 4, "tag": ""}))  # the real reducer, same case


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_metric_extrema_are_true_min_max_across_dp(tmp_path_factory):
    """DP=2: tis/ratio_min|max and weight_min|max equal the single-process extrema; a mean of per-rank
    minima (the control reducer) does not."""
    results = _results("main2", tmp_path_factory)
    keys = ("tis/ratio_min", "tis/ratio_max", "tis/weight_min", "tis/weight_max")
    real = [r for r in _of(results, dict(layout="dp2", case="a2_tok_trunc", M=4)) if r["last_stage"]]
    control = [r for r in _of(results, dict(layout="dp2", case="a2_tok_trunc", M=2, tag="mean_of_minima"))
               if r["last_stage"]]
    for r in real:
        for k in keys:
            assert _rel(r["metrics"][k], r["oracle_metrics"][k]) <= 1e-5, (k, r["metrics"][k],
                                                                            r["oracle_metrics"][k])
    for r in control:
        wrong = [k for k in keys if _rel(r["metrics"][k], r["oracle_metrics"][k]) > 1e-3]
        assert "tis/ratio_min" in wrong and "tis/weight_min" in wrong, wrong


def _assert_rollout_matches_hand_ppo(rows: list[dict], check: dict) -> None:
    """Every step: gradients (1e-5), loss and Megatron-LM's logged loss (1e-5 relative), clip fraction equal
    to the hand computation; pi_old computed once and never modified; no per-step recompute."""
    for r in rows:
        assert len(r["steps"]) == (1 if check["kind"] == "supplied" else 2)
        for s, st in enumerate(r["steps"]):
            assert st["finite"] and st["n_params"] > 0
            assert st["grad_err"] <= GRAD_RTOL, (s, st["grad_err_param"], st["grad_err"])
            # no forward-only pass: pi_old once per rollout, or supplied (used as given; keep denominator)
            assert not st["recomputed"]
            if r["last_stage"]:
                assert _rel(st["loss"], st["oracle_loss"]) <= LOSS_RTOL, (s, st["loss"], st["oracle_loss"])
                assert _rel(st["logged_loss"], st["oracle_loss"]) <= LOSS_RTOL, (s, st["logged_loss"])
                # counts of tokens (exact) unless a ratio sits within float32 rounding of a clip bound
                assert abs(st["clipfrac"] - st["oracle_clipfrac"]) <= 0.02, (s, st["clipfrac"], st["oracle_clipfrac"])
                assert st["logged_clipfrac"] == pytest.approx(st["clipfrac"], rel=1e-6, abs=1e-9)
        if r["last_stage"]:
            assert r["pi_old_unchanged"] and r["pi_old_present"]
    clipped = [st["oracle_clipfrac"] for r in rows for st in r["steps"][-1:]]
    assert min(clipped) > 0.1, f"the clip must act in the last step (hand clip fraction {clipped})"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", ONE, ids=check_id)
def test_one_process_several_steps_per_rollout(check, tmp_path_factory):
    """One process: 2 optimizer steps on one rollout with pi_old computed once, algorithms 0 and 2; and
    caller-supplied pi_old (lp - 0.5) used exactly as given (clip fraction ~1 as computed by hand)."""
    _assert_rollout_matches_hand_ppo(_of(_results("one", tmp_path_factory), check), check)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_per_step_recompute_is_not_ppo_on_the_second_step(tmp_path_factory):
    """Control: pi_old at each step's own parameters (the per-call mode, as the old per-step recompute) makes
    rho = 1 in step 2: no clip and a loss that differs from the hand computation; the caller's TISBatch objects
    are not modified."""
    rows = _of(_results("one", tmp_path_factory), dict(layout="single", case="a0", M=2, tag="per_step_control"))
    for r in rows:
        step2 = r["steps"][1]
        assert step2["clipfrac"] == 0.0 and step2["oracle_clipfrac"] > 0.1
        assert _rel(step2["loss"], step2["oracle_loss"]) > 1e-2
        assert r["pi_old_unchanged"] and not r["pi_old_present"]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", ROLLOUT2, ids=check_id)
def test_several_steps_per_rollout_under_pp2_and_dp2(check, tmp_path_factory):
    """PP=2 and DP=2: the same two-step rollout (and supplied pi_old under PP=2) against the hand computation."""
    _assert_rollout_matches_hand_ppo(_of(_results("main2", tmp_path_factory), check), check)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_unknown_data_parallel_wrapper_is_an_error(tmp_path_factory):
    """DP=2 with a wrapper the hook cannot read: every rank raises, naming grad_average=, before any step."""
    results = _results("main2", tmp_path_factory)
    rows = [r for r in results if r.get("tag") == "opaque_wrapper"]
    assert len(rows) == 2
    for r in rows:
        assert "error" in r and "grad_average=" in r["error"] and "OpaqueWrapper" in r["error"], r.get("error")


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_schedule_keywords_reach_the_launchers_forward_step(tmp_path_factory):
    """Megatron's combined 1F1B schedule calls forward_step(it, model, return_schedule_plan=True): the hook's
    wrappers (recompute pass and training) forward every keyword unchanged; the step still matches the oracle."""
    rows = _of(_results("one", tmp_path_factory), dict(layout="single", case="a2_seq_mask_bn", M=2, tag="keyword"))
    _assert_matches_oracle(rows)
    for r in rows:  # algorithm 2 with batch normalisation: a pi_old pass before training
        assert r["seen_keywords"] == [{"return_schedule_plan": False}] * 4  # M = 2: pi_old pass + training


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_rank_without_rollout_log_probs_does_not_hang(tmp_path_factory):
    """Algorithm 0 (diagnostics optional) where DP rank 1's micro-batches have no rollout log-probs: the step's
    collectives still match. Either every rank stops with the metric-schema error (before the reduction; the
    core's statistics then depend on the data) or, with a fixed schema, the step is right: loss and gradients
    equal the oracle (algorithm 0's loss does not use rollout log-probs)."""
    results = _results("main2", tmp_path_factory)
    rows = [r for r in results if r.get("tag") == "no_rollout_rank1"]
    assert len(rows) == 2
    errors = [r.get("error") for r in rows]
    if any(errors):
        assert all(e and "differ across data-parallel x context-parallel ranks" in e for e in errors), errors
        return
    for r in rows:
        assert r["grad_err"] <= GRAD_RTOL and r["finite"]
        if r["last_stage"]:
            assert _rel(r["loss"], r["oracle_loss"]) <= LOSS_RTOL
            assert _rel(r["logged_loss"], r["oracle_loss"]) <= LOSS_RTOL
