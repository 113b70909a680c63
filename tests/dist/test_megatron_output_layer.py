"""The hook's output-layer modes in real ``torchrun`` processes (gloo, CPU): 1 process and 2 (TP=2, PP=2).

``output_layer_hook_worker.py`` runs a tiny megatron-core GPT (megatron DDP, the harness's RL data with its
NaN / veto traps, algorithm 2 token truncate, 2 micro-batches) through ``tis_forward_backward_func``:
``compute_old_log_probs`` then one training step, unfused and with ``fused_output_layer=True``, and asserts:

* pi_old from the fused pass equals the unfused one; the loss, the loss Megatron-LM's ``train_step`` logs,
  every metric (``last_metrics`` and as logged) and every parameter gradient equal the unfused step's;
* the fused mode really ran: the launcher's ``forward_step`` saw hidden states ``[..., H]`` on the last stage in
  both passes (the unfused run: ``[..., V/TP]`` logits), and the model is back to its stock output layer after
  the calls; the per-call recompute (``pi_old="auto"``) in fused mode gives the same step;
* tied embeddings (the output weight is the embedding's) alike, at TP=1 and TP=2;
* a model switched to fused mode behind the hook's back is an error (never hidden states read as logits), a
  model in the other mode too; one the launcher switched to the hook's own mode stays switched;
* ``fp32_lm_head=True`` on a bf16 model: float32 logits in the pi_old pass and in the training step (stock:
  bf16 in both), its pi_old equal to the fused one (both: float32 logits of the same bf16 operands) while the
  stock bf16 logits' pi_old differs by far more.

Tolerances. Everything but the fp32 check is float32; the two paths differ in summation order only (over H for
the logits, over V for the log-sum-exp, and over TP ranks): log-probs to ~1e-6 absolute (|lp| < 10), so 1e-5
absolute on pi_old and 1e-5 relative on the loss, the metrics (smooth in the log-probs; counts exact unless a
ratio sits within 1e-6 of a bound, not the case in this data) and on each gradient (max-abs error / max-abs
value, the tolerance of tests/dist/test_megatron_dist.py against its oracle). fp32 check: float32 logits of bf16
operands agree to float32 rounding of |z| <= ~15 (1e-4), bf16 rounding of the logits is ~|z| * 2^-8.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _launch import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 420
HIDDEN, VOCAB = 32, 64
REL = 1e-5


_CACHE: dict[int, list[dict]] = {}


def _results(nproc: int, tmp_path_factory) -> list[dict]:
    if nproc in _CACHE:
        return _CACHE[nproc]
    out = tmp_path_factory.mktemp(f"ol_hook_{nproc}")
    torchrun(HERE / "output_layer_hook_worker.py", ["--out", str(out)], nproc=nproc, timeout=TIMEOUT_S)
    rows = []
    for r in range(nproc):
        rows += [json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()]
    _CACHE[nproc] = rows
    return rows


def _rows(nproc, name, tmp_path_factory):
    rows = [r for r in _results(nproc, tmp_path_factory) if r["name"] == name]
    assert len(rows) == nproc, f"{name}: results from {len(rows)} of {nproc} ranks"
    for row in rows:
        assert "error" not in row, row["error"]
    return rows


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=REL) or (math.isnan(a) and math.isnan(b))


FUSED = [(1, "fused_single_untied_auto"), (1, "fused_single_tied"), (2, "fused_tp2_untied"),
         (2, "fused_tp2_tied_auto"), (2, "fused_pp2_untied")]


@pytest.mark.parametrize("nproc,name", FUSED)
def test_fused_hook_step_equals_the_unfused_one(nproc, name, tmp_path_factory):
    tp = 2 if "tp2" in name else 1
    for row in _rows(nproc, name, tmp_path_factory):
        assert row["same_params"] and row["n_params"] >= 10, row
        assert row["grad_err"] <= REL, (row["grad_err"], row["grad_err_param"])
        assert row["tied"] == ("_tied" in name)
        assert row["mode_after"] is None  # the hook switched the model back
        if not row["last_stage"]:
            continue
        assert row["pi_old_finite"] and row["pi_old_err"] <= 1e-5, row["pi_old_err"]
        for pass_name, (fused, stock) in row["seen"].items():  # the launcher's forward_step, last stage
            assert fused == [[HIDDEN, "torch.float32"]] * 2, (pass_name, fused)
            assert stock == [[VOCAB // tp, "torch.float32"]] * 2, (pass_name, stock)
        for run, per_source in row["metrics"].items():
            for source, (got, ref) in per_source.items():
                assert sorted(got) == sorted(ref) and "loss" in got, (run, source)
                bad = {k: (got[k], ref[k]) for k in ref if not _close(got[k], ref[k])}
                assert not bad, (run, source, bad)
        if "auto" in name:  # pi_old from the fused training forward itself: no pass, same gradients
            assert not row["auto_recomputed"] and row["auto_grad_err"] <= REL, row
            assert row["auto_seen"] == [[HIDDEN, "torch.float32"]] * 2  # the training step only


@pytest.mark.parametrize("nproc,name", [(1, "fp32_single"), (2, "fp32_tp2")])
def test_fp32_lm_head_gives_float32_logits_in_both_passes(nproc, name, tmp_path_factory):
    vp = VOCAB // nproc
    for row in _rows(nproc, name, tmp_path_factory):
        for mode, dtype, width in (("stock", "torch.bfloat16", vp), ("fp32", "torch.float32", vp),
                                   ("fused", "torch.float32", HIDDEN)):  # Float16Module is not used: see worker
            r = row[mode]
            if mode == "fused":
                dtype = "torch.bfloat16"  # a bf16 model's hidden states; the kernel accumulates in float32
            assert r["seen_old"] == [[width, dtype]] * 2, (mode, r)      # the pi_old pass
            assert r["seen_train"] == [[width, dtype]] * 2, (mode, r)    # the training step
            assert r["mode_after"] is None and r["grad_finite"] and math.isfinite(r["loss"]), (mode, r)
        assert row["pi_old_fp32_vs_fused"] <= 1e-4, row
        assert row["pi_old_stock_vs_fused"] >= 10 * max(row["pi_old_fp32_vs_fused"], 1e-5), row


def test_a_model_switched_behind_the_hooks_back_is_an_error(tmp_path_factory):
    (row,) = _rows(1, "misuse", tmp_path_factory)
    # hidden states never read as logits (they would give finite, wrong log-probs over H "classes")
    assert "returns hidden states" in row["fused_model_plain_hook"], row
    assert "--tis-fused-output-layer" in row["fused_model_plain_hook"], row
    assert "already in mode 'fp32'" in row["fp32_model_fused_hook"], row
    assert row["kept_launchers_mode"] == "fused", row  # switched by the launcher: left switched
