"""The Triton token pass + per-sequence sums (``slime_tis.kernels.correction``) against the torch reference,
on the CPU under ``TRITON_INTERPRET=1`` (the CI path; on CUDA the core uses the kernel).

Tolerances: ``l`` is the same float32 subtraction on both sides (exact); the per-sequence sums are float64
sums of the same float32 values in another order: 1e-12 relative."""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from slime_tis.core.packing import sequence_ids  # noqa: E402
from slime_tis.core.ratios import packed_ratios  # noqa: E402
from slime_tis.core.reducer import LocalReducer  # noqa: E402


def _batch(seed: int, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    lr = -4 * torch.rand(t, generator=g)
    lt = lr + 0.3 * torch.randn(t, generator=g)
    valid = torch.rand(t, generator=g) > 0.2
    adv = torch.randn(t, generator=g)
    if t > 8:  # traps: NaN / inf at valid and at masked tokens, in the log-probs and in an extra tensor
        lt[1], lr[3], adv[5], lt[7] = math.nan, -math.inf, math.inf, math.nan
        valid[7] = False
    return lt, lr, valid, cu, adv


@pytest.mark.parametrize("lengths", [[5, 0, 300, 1, 17], [1], [0, 0], [600, 3], [64] * 9])
@pytest.mark.parametrize("n_extra", [0, 1, 2])
def test_kernel_matches_torch_reference(lengths, n_extra):
    kernels = pytest.importorskip("slime_tis.kernels.correction")
    lt, lr, valid, cu, adv = _batch(sum(lengths) + n_extra, lengths)
    extra = (adv, lt.clone())[:n_extra]
    l_k, sums_k = kernels.sequence_sums(lt, lr, valid, cu.long(), extra, block=64)
    seq_id = sequence_ids(cu, lt.numel(), lt.device)
    ref = packed_ratios(lt, lr, valid, seq_id, len(lengths), LocalReducer(), extra_finite=extra)
    ref_l = torch.where(valid & ~torch.isnan(lt - lr) & ~torch.isinf(lt - lr), lt - lr, 0.0)
    for e in extra:
        ref_l = torch.where(valid & ~torch.isfinite(e), 0.0, ref_l)
    assert torch.equal(l_k, ref_l)
    full = ref.seq_sums[:, :4]
    finite_rows = torch.isfinite(full).all(1)
    torch.testing.assert_close(sums_k[finite_rows], full[finite_rows], rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isfinite(sums_k), torch.isfinite(full))


@pytest.mark.parametrize("cfg_kwargs", [dict(use_tis=True), dict(use_tis=True, level="geometric", mode="mask",
                                                                   veto_threshold=1e-2, seq_max_k3_threshold=1.0)])
def test_core_through_the_kernel_equals_the_torch_path(monkeypatch, cfg_kwargs):
    """The whole policy loss with the kernel forced (interpreter) equals the torch path."""
    kernels = pytest.importorskip("slime_tis.kernels.correction")
    from slime_tis import TISConfig, policy_loss

    calls = []
    real = kernels.sequence_sums
    monkeypatch.setattr(kernels, "sequence_sums", lambda *a, **k: calls.append(1) or real(*a, **k))

    lt, lr, valid, cu, adv = _batch(3, [40, 0, 7, 130, 1])
    cfg = TISConfig(**cfg_kwargs)
    outs = []
    for mode in ("0", "force"):  # torch path, then the kernel (interpreter)
        monkeypatch.setenv("SLIME_TIS_TRITON", mode)
        theta = (lt + 0.01).nan_to_num(0.0).requires_grad_(True)
        out = policy_loss(cfg, theta, lt, lr, adv, valid, cu)
        out.loss.backward()
        outs.append((out, theta.grad))
    assert calls, "the forced run did not take the kernel"
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-7)
    assert torch.equal(a.keep_mask, b.keep_mask)
    fa, fb = a.stats.finalize(), b.stats.finalize()
    assert fa.keys() == fb.keys()
    for k in fa:
        torch.testing.assert_close(fa[k], fb[k], rtol=1e-9, atol=1e-12)
