"""The loss path reads bf16 logits as they are: the same results as their float32 upcast, checked against float64.

megatron-core's ``Float16Module`` upcasts a bf16 model's logits to float32 unless called with
``fp32_output=False`` (the hook arranges that in its own passes, ``output_layer.model_dtype_output_during``,
checked below). The upcast is exact and the log-prob path computes in float32 from any input dtype, so
reading the bf16 logits must give bit-identical log-probs and entropies, and a bf16 logit gradient equal to the
float32 gradient rounded to bf16 (what the upcast's backward returns). Accuracy against float64 log_softmax of
the same (bf16) logits is measured and asserted at 1e-5 absolute: ``lp = x_y - logZ`` and ``H`` are differences
of float32 numbers up to ~40 here (logits of scale 6 at temperature 0.8), each rounded to 2^-24 * 40 ~ 2.4e-6,
plus the O(V) float32 sum inside ``logZ`` (measured: 2.8e-6 on lp, 4.3e-6 on H; printed with ``-s``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import slime_tis.megatron.output_layer as output_layer
from slime_tis.megatron import vocab_parallel_log_probs_and_entropy as lp_and_entropy


def _case(t=257, v=3001, scale=6.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=g) * scale).bfloat16()
    logits[5, 100:] = float("-inf")  # a -inf tail (masked vocabulary entries)
    targets = torch.randint(0, 100, (t,), generator=g)
    mask = torch.rand(t, generator=g) > 0.2
    w_lp, w_h = torch.randn(t, generator=g), torch.randn(t, generator=g)
    return logits, targets, mask, w_lp, w_h


def _run(logits, targets, mask, w_lp, w_h, upcast: bool):
    z = logits.clone().requires_grad_(True)
    lp, ent = lp_and_entropy(z.float() if upcast else z, targets, temperature=0.8, chunk_size=64, tp_group=None,
                             row_mask=mask, kernels="torch")
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_h).sum(), z)
    return lp.detach(), ent.detach(), grad


def test_bf16_logits_give_the_upcast_results_bit_for_bit_and_float64_accuracy():
    case = _case()
    lp, ent, grad = _run(*case, upcast=False)
    lp32, ent32, grad32 = _run(*case, upcast=True)
    assert grad.dtype == torch.bfloat16 and grad32.dtype == torch.bfloat16
    assert torch.equal(lp, lp32) and torch.equal(ent, ent32) and torch.equal(grad, grad32)
    logits, targets, mask, _, _ = case
    lsm = torch.log_softmax(logits.double() / 0.8, dim=-1)
    lp64 = torch.where(mask, lsm.gather(-1, targets[:, None]).squeeze(-1), 0.0)
    ent64 = torch.where(mask, -(lsm.exp() * torch.where(lsm.isinf(), 0.0, lsm)).sum(-1), 0.0)
    err_lp, err_h = float((lp.double() - lp64).abs().max()), float((ent.double() - ent64).abs().max())
    print(f"bf16 logits read as bf16: max |lp - lp64| = {err_lp:.2e}, max |H - H64| = {err_h:.2e} "
          f"(|lp| up to {float(lp64.abs().max()):.1f})")
    assert err_lp <= 1e-5 and err_h <= 1e-5


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(output_layer, "_warned", False)


def test_float32_logits_from_a_bf16_model_warn_once_naming_the_fix(fresh_warning):
    bf16_model = torch.nn.Linear(4, 8).bfloat16()
    fp32_model = torch.nn.Linear(4, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        output_layer.warn_if_upcast_logits(torch.zeros(2, 8, dtype=torch.bfloat16), bf16_model)  # model dtype: fine
        output_layer.warn_if_upcast_logits(torch.zeros(2, 8), fp32_model)  # float32 model: fine
        output_layer.warn_if_upcast_logits(torch.zeros(2, 8), None)  # unknown model: nothing to compare
        assert not seen
        output_layer.warn_if_upcast_logits(torch.zeros(2, 8), bf16_model)
        output_layer.warn_if_upcast_logits(torch.zeros(3, 8), bf16_model)
    assert len(seen) == 1
    text = str(seen[0].message)
    assert "fp32_output=False" in text and "torch.bfloat16" in text and "--tis-fp32-lm-head" in text


def test_model_dtype_output_during_leaves_models_without_float16module_alone():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert output_layer.float16_modules([model]) == []
    with output_layer.model_dtype_output_during([model]):
        assert "forward" not in model.__dict__
