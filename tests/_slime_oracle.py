"""Test oracle for the slime hooks: slime's calling convention rebuilt from first principles.

* ``owner_layout``: which CP rank holds which response token, derived by brute force from slime's
  zigzag rule (``2 cp`` chunks of ``ceil(total / (2 cp))`` positions; rank ``r`` holds chunks ``r``
  and ``2cp-1-r``; the log-prob of response token ``j`` sits at logit position ``P - 1 + j``),
  one position at a time, independent of ``slime_tis.slime.layout``'s vectorised arithmetic.
* ``SlimeBatch``: a micro-batch of full-length per-sample tensors and its CP-local views.
* ``slime_sum_of_sample_mean``: slime's per-sample reducer (``cp_utils.get_sum_of_sample_mean``
  with per-sample denominators from the original masks), CP-local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import Tensor


def owner_layout(total: int, resp: int, cp_size: int) -> list[list[int]]:
    """For each CP rank, the response indices it holds, in slime's local order (chunk 0 then chunk 1)."""
    if cp_size == 1:
        return [list(range(resp))]
    chunk = math.ceil(total / (2 * cp_size))
    prompt = total - resp
    halves = [[[], []] for _ in range(cp_size)]
    for j in range(resp):
        g = prompt - 1 + j  # logit position predicting response token j
        c = g // chunk
        rank, half = (c, 0) if c < cp_size else (2 * cp_size - 1 - c, 1)
        halves[rank][half].append(j)
    return [h[0] + h[1] for h in halves]


@dataclass
class SlimeBatch:
    """Full-length per-sample data of one micro-batch (CPU tensors)."""

    prompt_lengths: list[int]
    response_lengths: list[int]
    train: list[Tensor]
    rollout: list[Tensor]
    masks: list[Tensor]
    pg_loss: list[Tensor]
    advantages: list[Tensor]
    tokens: list[Tensor] = field(default_factory=list)  # prompt + response token ids

    @property
    def total_lengths(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_lengths, self.response_lengths)]

    def local(self, name: str, cp_rank: int, cp_size: int) -> list[Tensor]:
        """CP-local per-sample list of a full-length per-sample quantity."""
        out = []
        for x, t, r in zip(getattr(self, name), self.total_lengths, self.response_lengths):
            idx = owner_layout(t, r, cp_size)[cp_rank]
            out.append(x[torch.tensor(idx, dtype=torch.long)] if idx else x[:0])
        return out

    def local_flat(self, name: str, cp_rank: int, cp_size: int) -> Tensor:
        return torch.cat(self.local(name, cp_rank, cp_size))

    def packed(self, name: str) -> Tensor:
        return torch.cat(getattr(self, name))

    def cu_seqlens(self) -> Tensor:
        return torch.tensor([0, *torch.cumsum(torch.tensor(self.response_lengths), 0).tolist()])

    def scatter_local(self, local_flat: Tensor, cp_rank: int, cp_size: int) -> Tensor:
        """Place a CP-local flat tensor at its full-length packed positions (zeros elsewhere)."""
        out = torch.zeros(sum(self.response_lengths), dtype=local_flat.dtype)
        pos, base = [], 0
        for t, r in zip(self.total_lengths, self.response_lengths):
            pos += [base + j for j in owner_layout(t, r, cp_size)[cp_rank]]
            base += r
        out[torch.tensor(pos, dtype=torch.long)] = local_flat.detach()
        return out


def make_batch(seed: int = 0, *, vocab: int = 11) -> SlimeBatch:
    """Samples chosen for CP=2 edge cases: a CP rank with no response token, one-token responses,
    tool tokens (mask 0), NaN at masked positions, a non-finite valid token, a catastrophic token."""
    g = torch.Generator().manual_seed(seed)
    prompts = [3, 14, 5, 2, 6, 4]
    resps = [9, 2, 7, 1, 12, 8]  # sample 1: total 16, cp 2 -> rank 1 holds none of its response
    train, rollout, masks, pg, adv, tokens = [], [], [], [], [], []
    for i, (p, r) in enumerate(zip(prompts, resps)):
        lt = -torch.rand(r, generator=g) * 3.0 - 0.05
        lr = lt + 0.25 * torch.randn(r, generator=g)
        m = torch.ones(r)
        if i == 0:
            m[3:5] = 0  # tool tokens
            lr[3] = float("nan")  # masked NaN: ignored
            lt[4] = float("inf")
        if i == 2:
            lr[5] = float("nan")  # valid NaN: whole sample rejected
        if i == 4:
            lr[7] = lt[7] + 9.0  # catastrophic token (ratio e^-9) for the veto
            m[10:] = 0
        train.append(lt)
        rollout.append(lr)
        masks.append(m)
        loss = torch.randn(r, generator=g)
        if i == 0:
            loss[3] = float("nan")  # NaN loss at a masked position must not leak
        pg.append(loss)
        adv.append(torch.full((r,), float(torch.randn(1, generator=g))))
        tokens.append(torch.randint(0, vocab, (p + r,), generator=g))
    return SlimeBatch(prompts, resps, train, rollout, masks, pg, adv, tokens)


def slime_sum_of_sample_mean(x_local: Tensor, batch: SlimeBatch, masks_full: list[Tensor], cp_rank: int,
                             cp_size: int, denom_masks: list[Tensor] | None = None) -> Tensor:
    """slime's per-sample reducer on this CP rank: sum_i sum_{t local} x_t m_t / max(sum_t M_t, 1).

    ``masks_full`` are the (possibly modified) numerator masks, ``denom_masks`` the original masks
    (slime's ``rollout_mask_sums``); summed over CP ranks this is the exact per-sample mean.
    """
    denom_masks = denom_masks or batch.masks
    total = torch.zeros(())
    start = 0
    for m, d, t, r in zip(masks_full, denom_masks, batch.total_lengths, batch.response_lengths):
        idx = owner_layout(t, r, cp_size)[cp_rank]
        n = len(idx)
        xi = x_local[start:start + n]
        mi = m[torch.tensor(idx, dtype=torch.long)] if idx else m[:0]
        total = total + (xi * mi).sum() / d.sum().clamp(min=1)
        start += n
    return total


def args_ns(**kw) -> SimpleNamespace:
    """A slime-like args namespace with slime's defaults for the fields the hooks read."""
    base = dict(use_tis=False, use_rollout_logprobs=False, get_mismatch_metrics=False, calculate_per_token_loss=False,
                eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, rollout_temperature=1.0, entropy_coef=0.0,
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", rollout_top_p=1.0)
    base.update(kw)
    return SimpleNamespace(**base)
