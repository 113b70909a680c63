"""The sampling-support replay of the log-softmax (torch path, one process): values and gradients against a
float64 masked log-softmax, on random supports, a support of one token, the whole vocabulary, ids at the edges.

Tolerances: the pass computes in float32 (logits of magnitude ~15 after the temperature); 2e-5 absolute on the
log-probs, entropies and gradients is ~10 float32 ulps of the largest term (the same bound as
tests/test_kernels_logprobs.py). bfloat16 logits are exact in float32, so the same bound holds for values; their
gradient is rounded to bfloat16 (relative 2**-8), bounded by 2**-7 of the largest gradient.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _interpret import reset_dispatch

from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
from slime_tis.kernels import dispatch

V, T, TAU = 40, 9, 0.7


def make_case(seed: int = 0, vocab: int = V, n: int = T):
    """Logits, targets and CSR supports: random sizes, plus a single-token row, a whole-vocabulary row and rows
    holding the ids 0, vocab // 2 - 1, vocab // 2, vocab - 1 (the TP=2 shard edges)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    rows = []
    for _ in range(n):
        k = int(torch.randint(1, vocab // 2, (1,), generator=g))
        rows.append(torch.randperm(vocab, generator=g)[:k].tolist())
    rows[0] = [17]                                           # one token
    rows[1] = list(range(vocab))[::-1]                       # the whole vocabulary (any order)
    rows[2] = [0, vocab // 2 - 1, vocab // 2, vocab - 1]     # both sides of the shard boundary
    rows[3] = [vocab // 2, 3]
    targets = torch.tensor([r[int(torch.randint(0, len(r), (1,), generator=g))] for r in rows])
    targets[2], targets[3] = vocab // 2 - 1, vocab // 2
    ids = torch.tensor([i for r in rows for i in r], dtype=torch.int32)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(r) for r in rows]), 0)
    return logits, targets, ids, offsets, rows


def oracle(logits, targets, rows, w_lp, w_h, keep=None, tau=TAU):
    """float64 masked log-softmax: -inf outside each row's support, then log_softmax; values and the gradient."""
    z = logits.detach().double().requires_grad_(True)
    mask = torch.zeros(z.shape, dtype=torch.bool)
    for t, r in enumerate(rows):
        mask[t, r] = True
    lsm = torch.log_softmax((z / tau).masked_fill(~mask, float("-inf")), dim=-1)
    lp = lsm.gather(1, targets[:, None]).squeeze(1)
    ent = -(lsm.exp() * lsm.masked_fill(~mask, 0.0)).sum(-1)
    if keep is not None:
        lp, ent = torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)
    (grad,) = torch.autograd.grad((lp * w_lp.double()).sum() + (ent * w_h.double()).sum(), z)
    return lp.detach(), ent.detach(), grad, mask


def run(logits, targets, ids, offsets, w_lp, w_h, **kw):
    z = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs_and_entropy(z, targets, temperature=kw.pop("tau", TAU), tp_group=None,
                                                   support=(ids, offsets), **kw)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_h).sum(), z)
    return lp.detach(), ent.detach(), grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_float64_masked_log_softmax_values_and_gradients(seed):
    logits, targets, ids, offsets, rows = make_case(seed)
    g = torch.Generator().manual_seed(100 + seed)
    w_lp, w_h = torch.randn(T, generator=g), torch.randn(T, generator=g)
    lp_ref, ent_ref, grad_ref, mask = oracle(logits, targets, rows, w_lp, w_h)
    lp, ent, grad = run(logits, targets, ids, offsets, w_lp, w_h)
    assert (lp.double() - lp_ref).abs().max() < 2e-5
    assert (ent.double() - ent_ref).abs().max() < 2e-5
    assert (grad.double() - grad_ref).abs().max() < 2e-5
    assert (grad[~mask] == 0).all()                  # gradients through the kept logits only
    assert lp[0] == 0 and ent[0] == 0 and (grad[0] == 0).all()   # one token: q = 1, nothing to learn


def test_whole_vocabulary_support_equals_the_full_log_softmax():
    logits, targets, *_ = make_case(3)
    ids = torch.arange(V, dtype=torch.int32).repeat(T)
    offsets = torch.arange(T + 1, dtype=torch.int64) * V
    w_lp, w_h = torch.randn(T), torch.randn(T)
    lp, ent, grad = run(logits, targets, ids, offsets, w_lp, w_h)
    z = logits.clone().requires_grad_(True)
    lp_f, ent_f = vocab_parallel_log_probs_and_entropy(z, targets, temperature=TAU, tp_group=None)
    (grad_f,) = torch.autograd.grad((lp_f * w_lp).sum() + (ent_f * w_h).sum(), z)
    assert (lp - lp_f).abs().max() < 2e-5 and (ent - ent_f).abs().max() < 2e-5
    assert (grad - grad_f).abs().max() < 2e-5


def test_masked_rows_bad_rows_and_bfloat16():
    logits, targets, ids, offsets, rows = make_case(4)
    keep = torch.ones(T, dtype=torch.bool)
    keep[[4, 6]] = False
    nan_logits = logits.clone()
    nan_logits[~keep] = float("nan")                 # masked rows are never read into a value or a gradient
    w_lp, w_h = torch.randn(T), torch.randn(T)
    lp_ref, ent_ref, grad_ref, _ = oracle(logits, targets, rows, w_lp, w_h, keep=keep)
    lp, ent, grad = run(nan_logits, targets, ids, offsets, w_lp, w_h, row_mask=keep)
    assert (lp.double() - lp_ref).abs().max() < 2e-5 and (ent.double() - ent_ref).abs().max() < 2e-5
    assert torch.isfinite(grad).all() and (grad.double() - grad_ref).abs().max() < 2e-5
    b = logits.to(torch.bfloat16)
    lp_ref, ent_ref, grad_ref, _ = oracle(b.float(), targets, rows, w_lp, w_h)
    lp, ent, grad = run(b, targets, ids, offsets, w_lp, w_h)
    assert grad.dtype == torch.bfloat16 and (lp.double() - lp_ref).abs().max() < 2e-5
    assert (grad.double() - grad_ref).abs().max() < 2**-7 * float(grad_ref.abs().max()) + 1e-5


def test_target_outside_or_empty_support_is_nan_never_a_full_vocabulary_value():
    logits = torch.randn(3, V)
    targets = torch.tensor([5, 6, 7])
    ids = torch.tensor([1, 2, 6], dtype=torch.int32)              # row 0: {1, 2} lacks 5; row 1: {6}; row 2: empty
    offsets = torch.tensor([0, 2, 3, 3])
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, targets, tp_group=None, support=(ids, offsets))
    assert lp[0].isnan() and lp[1] == 0 and lp[2].isnan() and ent[2].isnan()
    lp, _ = vocab_parallel_log_probs_and_entropy(logits, targets, tp_group=None, support=(ids, offsets),
                                                 row_mask=torch.tensor([True, True, False]))
    assert lp[2] == 0                                             # an empty row outside the mask (a prompt)


def test_bad_arguments_name_the_argument():
    logits, targets, ids, offsets, _ = make_case(0)
    with pytest.raises(ValueError, match=f"support_offsets has {T} entries; the logits have {T} rows, so it "
                                         f"needs {T + 1}"):
        vocab_parallel_log_probs_and_entropy(logits, targets, tp_group=None, support=(ids, offsets[:-1]))
    with pytest.raises(ValueError, match="support_ids must be a 1-D integer tensor, got torch.float32"):
        vocab_parallel_log_probs_and_entropy(logits, targets, tp_group=None, support=(ids.float(), offsets))
    with pytest.raises(ValueError, match="support must be a pair"):
        vocab_parallel_log_probs_and_entropy(logits, targets, tp_group=None, support=ids)


def test_triton_request_on_cpu_warns_once_and_runs_the_torch_replay():
    """Without CUDA (and without the interpreter) ``kernels="triton"`` falls back to the torch replay, warned once;
    the kernels themselves: tests/test_kernels_support.py."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter would run the kernels")
    reset_dispatch()
    logits, targets, ids, offsets, _ = make_case(5)
    w = torch.ones(T)
    ref = run(logits, targets, ids, offsets, w, w)
    with pytest.warns(dispatch.KernelFallbackWarning, match="tensors on cpu"):
        got = run(logits, targets, ids, offsets, w, w, kernels="triton")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(logits, targets, ids, offsets, w, w, kernels="triton")       # once per process
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    reset_dispatch()
