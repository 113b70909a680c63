"""The correction's cost in full-length passes: one ``compute_tis`` call plus ``stats.finalize()`` of each
configuration of ``benchmarks/bench_correction.py`` runs at most a fixed number of tensor operations over the
tokens (counted at aten level under a ``TorchDispatchMode``, views excluded; torch 2.13 on the CPU). A feature that
is off must add none to the default row; one more pass there fails this test.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slime_tis import TISConfig, compute_tis

_METADATA = ("detach", "view", "select", "slice", "alias", "expand", "unsqueeze", "squeeze", "as_strided")

#: (configuration, token passes): the budget of each bench_correction row.
BUDGET = (
    (TISConfig(use_tis=True), 36),  # token truncate at 2: the default
    (TISConfig(use_tis=True, level="sequence"), 19),
    (TISConfig(use_tis=True, mode="mask", level="sequence", lower=0.5, upper=2.0, rs_level="sequence",
               rs_lower=0.5, rs_upper=2.0), 21),
    (TISConfig(use_tis=True, mode="mask", level="geometric", lower=0.999, upper=1.001, veto_threshold=1e-4), 26),
    (TISConfig(use_tis=True, mode="clip", level="token", lower=0.5, upper=2.0, rs_level="token", rs_lower=0.5,
               rs_upper=2.0, batch_normalize=True), 56),
)


class _TokenPasses(TorchDispatchMode):
    def __init__(self, n_tokens: int) -> None:
        super().__init__()
        self.n_tokens, self.count = n_tokens, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not any(m in name for m in _METADATA) and any(
                isinstance(a, torch.Tensor) and a.numel() >= self.n_tokens for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 513, (64,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(cu[-1])
    lp_rollout = -6.0 * torch.rand(n, generator=g) ** 2
    lp_old = lp_rollout + 0.02 * torch.randn(n, generator=g)
    lp_old[::5000] = lp_rollout[::5000] - 11.5  # a few catastrophic tokens
    mask = torch.rand(n, generator=g) > 0.1
    return lp_old, lp_rollout, mask, cu


def test_each_configuration_stays_within_its_token_pass_budget():
    lp_old, lp_rollout, mask, cu = _batch()
    for cfg, budget in BUDGET:
        counter = _TokenPasses(lp_old.numel())
        with counter:
            compute_tis(cfg, lp_old, lp_rollout, mask, cu).stats.finalize()
        assert counter.count <= budget, (cfg, counter.count, budget)
        assert counter.count >= budget - 3, f"{cfg}: {counter.count} passes, lower the budget {budget}"
