"""The fused output layer at TP=2 in real ``torchrun`` processes (gloo, CPU), Triton via the interpreter.

One launch of ``kernels_output_layer_worker.py`` (``TRITON_INTERPRET=1`` in its environment, so triton is
imported in interpreter mode); every check becomes one test item here:

* the kernel on a vocabulary split over two ranks (torch and Triton backends) vs a float64 full-vocabulary
  oracle: log-probs, entropies, the full hidden gradient, each rank's shard of the weight gradient;
* a tiny megatron-core ``GPTModel`` at TP=2, untied and tied embeddings: the fused mode
  (``use_fused_output_layer`` + ``fused_log_probs``) reproduces the stock path (logits +
  ``vocab_parallel_log_probs_and_entropy``): values and every parameter gradient;
* the float32 LM head on a bf16 model: float32 logits, log-prob error vs float64 far below bf16 logits';
* misuse of the glue (fused log-probs from a stock model, switching modes) raises a clear error.

Tolerances: everything is float32 except the fp32-head check: 1e-5 absolute on values (|lp| < 10), 1e-5
relative (max-abs) on gradients (float32 rounding of O(H) and O(V) sums, summed over 2 ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import rank_outputs, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("kernels_ol_tp")
    torchrun(HERE / "kernels_output_layer_worker.py", ["--out", str(out)], timeout=TIMEOUT_S,
             env={"TRITON_INTERPRET": "1"})
    return rank_outputs(out, 2)


def _of(results, name):
    rows = [r[name] for r in results]
    for row in rows:
        assert "error" not in row, row.get("error")
    return rows


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernel_vocab_split_over_two_ranks_matches_float64(results, backend):
    for row in _of(results, f"kernel_{backend}"):
        assert row["lp"] <= 1e-5 and row["ent"] <= 1e-5, row
        assert row["grad_hidden"] <= 1e-5 and row["grad_weight"] <= 1e-5, row


@pytest.mark.parametrize("name", ["gpt_untied_torch", "gpt_tied_torch", "gpt_tied_triton"])
def test_gpt_fused_mode_reproduces_stock_output_layer(results, name):
    for row in _of(results, name):
        assert row["hidden_shape"] == [2, 8, 32], row          # the model returned hidden states [B, S, H]
        assert row["lp"] <= 1e-5 and row["ent"] <= 1e-5, row
        assert row["grad"] <= 1e-5, row                      # every parameter, incl. the (tied) embedding
        assert row["same_params"] and row["n_params"] > 20, row
        assert row["restored_logits"] == 0.0, row             # restore_output_layer gives the stock forward
        assert row["has_output_weight"] == ("untied" in name), row


def test_fp32_lm_head_keeps_logits_float32_and_is_more_accurate(results):
    for row in _of(results, "fp32_head"):
        assert row["dtypes"] == ["torch.bfloat16", "torch.float32"], row
        assert row["zmax"] > 5, row
        # float32 logits from the same bf16 operands: float32 rounding only (~1e-6) vs bf16 rounding of |z|
        assert row["err_fp32"] <= 1e-4 and row["err_fp32"] * 10 <= row["err_bf16"], row


def test_glue_misuse_is_a_clear_error(results):
    for row in _of(results, "errors"):
        assert "use_fused_output_layer" in row["not_fused"], row
        assert "already in mode 'fp32'" in row["mode_conflict"], row
