"""Test oracle for the slime hooks: slime's calling convention rebuilt from first principles.

* ``owner_layout``: which CP rank holds which response token, derived by brute force from slime's
  zigzag rule (``2 cp`` chunks of ``ceil(total / (2 cp))`` positions; rank ``r`` holds chunks ``r``
  and ``2cp-1-r``; the log-prob of response token ``j`` sits at logit position ``P - 1 + j``),
  one position at a time, independent of ``slime_tis.slime.layout``'s vectorised arithmetic.
* ``SlimeBatch``: a micro-batch of full-length per-sample tensors and its CP-local views.
* ``slime_sum_of_sample_mean``: slime's loss reducer, CP-local, as at THUDM/slime 624b824:
  ``get_sum_of_sample_mean`` (``slime/backends/megatron_utils/cp_utils.py``) called by ``loss_function``
  and, after the TIS function, by ``policy_loss_function`` (``slime/backends/megatron_utils/loss.py``)
  with the (modified) numerator masks and ``batch["rollout_mask_sums"]`` as denominators.
* Multi-sample rollouts: ``SlimeBatch.rollout_ids`` and ``rollout_mask_sums`` as built by
  ``RolloutManager._convert_samples_to_train_data`` (``slime/ray/rollout.py``): every sample carries the
  loss-mask total of its whole rollout. ``rollout_data`` is what slime hands the rollout-data hook, and
  ``subset`` a micro-batch as ``DataIterator.get_next`` (``slime/backends/megatron_utils/data.py``) builds
  it: lists of the *same* per-sample tensor objects.
* ``rollout_mean``: the loss the options define, one rollout at a time: the kept tokens' loss sum of each
  rollout divided by its valid-token count (``keep``) or its kept-token count (``drop``), summed over
  rollouts (slime then divides by the step's number of rollouts, ``step_global_batch_size``).
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
    rollout_ids: list[int] | None = None  # None: one sample per rollout
    step_mask_sums: Tensor | None = None  # a micro-batch's rollout_mask_sums, computed over the whole step

    @property
    def rollouts(self) -> list[int]:
        return list(range(len(self.masks))) if self.rollout_ids is None else list(self.rollout_ids)

    def rollout_mask_sums(self) -> Tensor:
        """slime's per-sample ``rollout_mask_sums``: the loss-mask total of the sample's whole rollout."""
        if self.step_mask_sums is not None:
            return self.step_mask_sums
        totals: dict[int, float] = {}
        for rid, m in zip(self.rollouts, self.masks):
            totals[rid] = totals.get(rid, 0.0) + float(m.sum())
        return torch.tensor([totals[rid] for rid in self.rollouts], dtype=torch.float32)

    def subset(self, idx: list[int]) -> SlimeBatch:
        """A micro-batch of samples ``idx`` holding the same tensor objects (as slime's data iterator)."""
        def pick(xs):
            return [xs[i] for i in idx] if xs else xs
        return SlimeBatch(pick(self.prompt_lengths), pick(self.response_lengths), pick(self.train),
                          pick(self.rollout), pick(self.masks), pick(self.pg_loss), pick(self.advantages),
                          pick(self.tokens), None if self.rollout_ids is None else pick(self.rollout_ids),
                          self.rollout_mask_sums()[torch.tensor(idx, dtype=torch.long)])

    def rollout_data(self) -> dict:
        """What slime passes its rollout-data hook (this rank's samples, same tensor objects)."""
        return {"loss_masks": self.masks, "rollout_ids": self.rollouts, "total_lengths": self.total_lengths,
                "response_lengths": self.response_lengths, "rollout_log_probs": self.rollout,
                "rollout_mask_sums": self.rollout_mask_sums()}

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
                             cp_size: int, denom_masks: list[Tensor] | None = None,
                             sample_denoms: Tensor | None = None) -> Tensor:
    """slime's reducer on this CP rank: ``sum_i sum_{t local} x_t m_t / max(D_i, 1)``.

    ``masks_full`` are the (possibly modified) numerator masks; ``D_i`` is ``sample_denoms[i]`` (slime's
    ``rollout_mask_sums``), by default the batch's ``rollout_mask_sums()`` (each sample's own original
    count when every rollout has one sample), or the sums of ``denom_masks``. Summed over CP ranks this
    is slime's whole micro-batch value.
    """
    if sample_denoms is None:
        sample_denoms = (torch.stack([d.sum() for d in denom_masks]) if denom_masks is not None
                         else batch.rollout_mask_sums())
    total = torch.zeros(())
    start = 0
    for m, d, t, r in zip(masks_full, sample_denoms, batch.total_lengths, batch.response_lengths):
        idx = owner_layout(t, r, cp_size)[cp_rank]
        n = len(idx)
        xi = x_local[start:start + n]
        mi = m[torch.tensor(idx, dtype=torch.long)] if idx else m[:0]
        total = total + (xi * mi).sum() / d.clamp(min=1)
        start += n
    return total


def rollout_mean(x_full: Tensor, keep_full: Tensor, batch: SlimeBatch, denominator: str) -> Tensor:
    """``sum_g sum_{t in g, kept} x_t / max(D_g, 1)``, ``D_g`` = valid (``keep``) or kept (``drop``) tokens
    of rollout ``g`` over all its samples; ``x_full``, ``keep_full`` full-length packed ``[sum R_i]``."""
    sample = torch.repeat_interleave(torch.arange(len(batch.masks)), torch.tensor(batch.response_lengths))
    rid = torch.tensor(batch.rollouts)[sample]
    valid = batch.packed("masks") != 0
    keep = keep_full & valid
    total = torch.zeros((), dtype=x_full.dtype)
    for g in sorted(set(batch.rollouts)):
        sel = rid == g
        d = (valid & sel).sum() if denominator == "keep" else (keep & sel).sum()
        total = total + torch.where(keep & sel, x_full, torch.zeros((), dtype=x_full.dtype)).sum() / d.clamp(min=1)
    return total


def args_ns(**kw) -> SimpleNamespace:
    """A slime-like args namespace with slime's defaults for the fields the hooks read."""
    base = dict(use_tis=False, use_rollout_logprobs=False, get_mismatch_metrics=False, calculate_per_token_loss=False,
                eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, rollout_temperature=1.0, entropy_coef=0.0,
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", rollout_top_p=1.0)
    base.update(kw)
    return SimpleNamespace(**base)
