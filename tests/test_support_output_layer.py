"""The sampling-support replay straight from the hidden states (``kernels.output_layer_support``): values and the
gradients of the hidden states and the output weight against a float64 masked log-softmax of ``h W^T``.

Tolerances: float32 dot products of ``H = 16`` terms and float32 sums (logits of magnitude ~5): 2e-5 absolute on
values and gradients (~10 float32 ulps of the largest term, as in tests/test_support_logprobs.py). bfloat16 inputs:
the products are exact in float32, the oracle reads the same rounded inputs, so values keep 2e-5; the gradients
are rounded to bfloat16 on return (relative 2**-8), bounded by 2**-7 of the largest one.
"""

from __future__ import annotations

import pytest
import torch
from test_support_logprobs import TAU, T, V, make_case

from slime_tis.kernels.output_layer_support import fused_support_log_probs_and_entropy

H = 16


def oracle(hidden, weight, targets, rows, w_lp, w_h, keep):
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    mask = torch.zeros(T, V, dtype=torch.bool)
    for t, r in enumerate(rows):
        mask[t, r] = True
    lsm = torch.log_softmax((h @ w.t() / TAU).masked_fill(~mask, float("-inf")), dim=-1)
    lp = lsm.gather(1, targets[:, None]).squeeze(1)
    ent = -(lsm.exp() * lsm.masked_fill(~mask, 0.0)).sum(-1)
    lp, ent = torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)
    gh, gw = torch.autograd.grad((lp * w_lp.double()).sum() + (ent * w_h.double()).sum(), (h, w))
    return lp.detach(), ent.detach(), gh, gw


def case(seed, dtype=torch.float32):
    _, targets, ids, offsets, rows = make_case(seed)
    g = torch.Generator().manual_seed(50 + seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.6).to(dtype)
    w_lp, w_h = torch.randn(T, generator=g), torch.randn(T, generator=g)
    keep = torch.ones(T, dtype=torch.bool)
    keep[5] = False
    return hidden, weight, targets, ids, offsets, rows, w_lp, w_h, keep


def run(hidden, weight, targets, ids, offsets, w_lp, w_h, keep, chunk_size=7):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fused_support_log_probs_and_entropy(h, w, targets, (ids, offsets), temperature=TAU, loss_mask=keep,
                                                  chunk_size=chunk_size)
    gh, gw = torch.autograd.grad((lp * w_lp).sum() + (ent * w_h).sum(), (h, w))
    return lp.detach(), ent.detach(), gh, gw


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_replay_equals_float64_oracle(seed):
    hidden, weight, targets, ids, offsets, rows, w_lp, w_h, keep = case(seed)
    nan_hidden = hidden.clone()
    nan_hidden[~keep] = float("nan")                        # masked rows are never read into a gradient
    got = run(nan_hidden, weight, targets, ids, offsets, w_lp, w_h, keep)
    ref = oracle(hidden, weight, targets, rows, w_lp, w_h, keep)
    for name, a, b in zip(("lp", "entropy", "d hidden", "d weight"), got, ref):
        assert torch.isfinite(a).all(), name
        assert (a.double() - b).abs().max() < 2e-5, name
    never_kept = torch.ones(V, dtype=torch.bool)
    for t, r in enumerate(rows):
        if keep[t]:
            never_kept[r] = False
    assert (got[3][never_kept] == 0).all()                  # gradients through the kept logits only


def test_fused_replay_bfloat16():
    hidden, weight, targets, ids, offsets, rows, w_lp, w_h, keep = case(2, torch.bfloat16)
    got = run(hidden, weight, targets, ids, offsets, w_lp, w_h, keep, chunk_size=1 << 16)
    ref = oracle(hidden.float(), weight.float(), targets, rows, w_lp, w_h, keep)
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    assert (got[0].double() - ref[0]).abs().max() < 2e-5 and (got[1].double() - ref[1]).abs().max() < 2e-5
    for a, b in zip(got[2:], ref[2:]):
        assert (a.double() - b).abs().max() < 2**-7 * float(b.abs().max()) + 1e-5
