"""``vocab_parallel_log_probs_and_entropy`` on one process: values, gradients, dtypes, edge cases, errors.

Oracle: float64 ``log_softmax(z / tau)`` with autograd. The tensor-parallel path (vocabulary split over
TP=2 gloo ranks) is checked in tests/dist (TP=2 layouts, loss and gradients vs a TP=1 oracle).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_tis.megatron import vocab_parallel_log_probs_and_entropy as lp_and_entropy


def _oracle(logits: torch.Tensor, targets: torch.Tensor, tau: float):
    z = logits.detach().double().requires_grad_(True)
    lsm = torch.log_softmax(z / tau, dim=-1)
    lp = lsm.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    return z, lp, ent


@pytest.mark.parametrize("tau", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_values_and_gradients_match_float64_log_softmax(tau, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g) * 3).requires_grad_(True)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    lp, ent = lp_and_entropy(logits, targets, temperature=tau, chunk_size=chunk_size, tp_group=None)
    z, lp_ref, ent_ref = _oracle(logits, targets, tau)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and lp.shape == (3, 7)
    torch.testing.assert_close(lp.double(), lp_ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=0, atol=2e-6)
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), logits)
    (grad_ref,) = torch.autograd.grad((lp_ref * w_lp.double()).sum() + (ent_ref * w_ent.double()).sum(), z)
    torch.testing.assert_close(grad.double(), grad_ref, rtol=0, atol=2e-6)


def test_gradient_of_log_probs_only():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 20, generator=g).requires_grad_(True)
    targets = torch.randint(0, 20, (9,), generator=g)
    lp, ent = lp_and_entropy(logits, targets, temperature=0.5, chunk_size=4, tp_group=None, with_entropy=False)
    assert ent is None
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    z, lp_ref, _ = _oracle(logits, targets, 0.5)
    (grad_ref,) = torch.autograd.grad(lp_ref.sum(), z)
    torch.testing.assert_close(grad.double(), grad_ref, rtol=0, atol=2e-6)
    # d lp / d z = (onehot - p) / tau: each row sums to 0
    torch.testing.assert_close(grad.sum(-1), torch.zeros(9), rtol=0, atol=1e-6)


def test_bfloat16_logits_are_computed_in_float32_and_grad_keeps_dtype():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 40, generator=g) * 4).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 40, (6,), generator=g)
    lp, ent = lp_and_entropy(logits, targets, temperature=0.9, chunk_size=4, tp_group=None)
    _, lp_ref, ent_ref = _oracle(logits.float(), targets, 0.9)  # same bf16 values, exact math
    torch.testing.assert_close(lp.double(), lp_ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=0, atol=2e-6)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    assert grad.dtype == torch.bfloat16


def test_input_logits_are_not_modified():
    """float32 input at temperature 1: the chunk copy must never alias the caller's logits."""
    logits = torch.randn(5, 11)
    before = logits.clone()
    lp, ent = lp_and_entropy(logits.requires_grad_(True), torch.zeros(5, dtype=torch.long), tp_group=None)
    torch.autograd.grad(lp.sum() + ent.sum(), logits)
    assert torch.equal(logits.detach(), before)


def test_minus_infinity_logits_are_masked_vocabulary_entries():
    """-inf logits (e.g. a vocabulary mask) have probability 0: finite values, entropy and gradients."""
    logits = torch.randn(4, 10)
    logits[:, 7:] = float("-inf")
    logits.requires_grad_(True)
    targets = torch.tensor([0, 3, 6, 2])
    lp, ent = lp_and_entropy(logits, targets, temperature=0.8, chunk_size=3, tp_group=None)
    _, lp_ref, _ = _oracle(logits[:, :7], targets, 0.8)
    ent_ref = -(torch.softmax(logits[:, :7].double() / 0.8, -1) * torch.log_softmax(logits[:, :7].double() / 0.8,
                                                                                      -1)).sum(-1)
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=0, atol=2e-6)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), logits)
    assert torch.isfinite(grad).all() and (grad[:, 7:] == 0).all()


def test_empty_input():
    logits = torch.zeros(0, 8, requires_grad=True)
    lp, ent = lp_and_entropy(logits, torch.zeros(0, dtype=torch.long), tp_group=None)
    assert lp.shape == (0,) and ent.shape == (0,)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), logits)
    assert grad.shape == (0, 8)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), v=st.integers(2, 30), chunk=st.integers(1, 16), seed=st.integers(0, 10_000))
def test_result_does_not_depend_on_chunk_size(n, v, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 5
    targets = torch.randint(0, v, (n,), generator=g)
    a = lp_and_entropy(logits, targets, chunk_size=chunk, tp_group=None)
    b = lp_and_entropy(logits, targets, chunk_size=n, tp_group=None)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature must be a number > 0, got 0.0"),
        (dict(temperature=-1), "temperature must be a number > 0, got -1"),
        (dict(chunk_size=0), "chunk_size must be an int >= 1, got 0"),
        (dict(chunk_size=2.5), "chunk_size must be an int >= 1, got 2.5"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lp_and_entropy(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), tp_group=None, **kwargs)


def test_bad_tensors_are_named():
    with pytest.raises(ValueError, match="targets must be an integer tensor"):
        lp_and_entropy(torch.randn(2, 4), torch.zeros(2), tp_group=None)
    with pytest.raises(ValueError, match=r"targets shape \(3,\) must equal logits shape without the vocab dim \(2,\)"):
        lp_and_entropy(torch.randn(2, 4), torch.zeros(3, dtype=torch.long), tp_group=None)
    with pytest.raises(ValueError, match="logits must be a floating tensor"):
        lp_and_entropy(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long), tp_group=None)
