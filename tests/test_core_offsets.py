"""``cu_seqlens`` checks on every path (compute_tis, policy_loss, loss_denominator), the device-side
assertion used for accelerator tensors, and the cached cross-device offsets (no per-call copy)."""

from __future__ import annotations

import pytest
import torch

from slime_tis import TISConfig, compute_tis, loss_denominator, policy_loss
from slime_tis.core.packing import assert_offsets_async, offsets_on

T = 6
LP = torch.linspace(-2.0, -0.5, T)
MASK = torch.ones(T, dtype=torch.bool)
BAD = {
    "first not 0": torch.tensor([1, 3, 6]),
    "decreasing": torch.tensor([0, 4, 2, 6]),
    "last < T": torch.tensor([0, 3, 5]),
    "last > T (out of bounds)": torch.tensor([0, 3, 9]),
}
CONFIGS = {
    "alg0": TISConfig(),
    "alg1": TISConfig(use_rollout_log_probs=True, veto_threshold=1e-3),
    "alg2 seq drop": TISConfig(use_tis=True, level="sequence", rejected_denominator="drop",
                               loss_agg="seq-mean-token-mean"),
    "alg3 geo": TISConfig(use_rollout_log_probs=True, use_tis=True, level="geometric", mode="mask"),
}
MESSAGE = "cu_seqlens must start at 0, be non-decreasing and end at T=6"


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("name", CONFIGS)
def test_bad_cu_seqlens_rejected_on_every_path(name, bad):
    cfg, cu = CONFIGS[name], BAD[bad]
    with pytest.raises(ValueError, match=MESSAGE):
        compute_tis(cfg, LP, LP - 0.1, MASK, cu)
    with pytest.raises(ValueError, match=MESSAGE):
        policy_loss(cfg, LP.clone().requires_grad_(True), LP, LP - 0.1, torch.ones(T), MASK, cu)
    with pytest.raises(ValueError, match=MESSAGE):
        loss_denominator(cfg, MASK, cu, keep_mask=MASK)
    for agg in ("token-mean", "seq-mean-token-sum"):
        with pytest.raises(ValueError, match=MESSAGE):
            loss_denominator(cfg.replace(loss_agg=agg), MASK, cu, keep_mask=MASK)


@pytest.mark.parametrize("bad", BAD)
def test_device_side_assertion_fires_on_bad_offsets(bad):
    """The accelerator path is ``torch._assert_async`` (on a CPU tensor it raises at once)."""
    with pytest.raises(RuntimeError):
        assert_offsets_async(BAD[bad], T)


def test_device_side_assertion_passes_good_offsets():
    for cu in (torch.tensor([0, 3, 6]), torch.tensor([0, 0, 6, 6]), torch.tensor([0, 6], dtype=torch.int32)):
        assert_offsets_async(cu, T)


def test_cross_device_offsets_copied_once_per_tensor():
    """A cu_seqlens on another device than the data is converted once per tensor (and again only after an
    in-place change), never per call (``meta`` stands in for an accelerator here)."""
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    meta = torch.device("meta")
    first = offsets_on(cu, meta)
    assert first.device == meta and first.dtype == torch.int64
    assert offsets_on(cu, meta) is first
    cu[1] = 2  # in-place change: the cached copy is stale
    assert offsets_on(cu, meta) is not first
    assert offsets_on(cu, torch.device("cpu")).dtype == torch.int64
