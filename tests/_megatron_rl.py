"""A stand-in for the parts of Megatron-LM's own RL loop that a host of the correction drives.

Modelled: NVIDIA/Megatron-LM commit d98e8a64dd (megatron-core 0.20.0), written here in this project's words (no
code copied), each piece checked against the named function while it was written:

* ``megatron/rl/rl_utils.py``
  - ``calculate_grpo_loss`` -> :func:`grpo_loss`: ``rho = exp(lp - lp_old)``, ``is_w = exp(lp_old - lp_inf)``
    (``min(is_w, coef)`` when ``--rl-importance-sampling-truncation-coef`` is set), per token
    ``loss = -is_w * min(rho A, clamp(rho, 1 - eps_lo, 1 + eps_hi) A) + beta * k3 - h * H`` with
    ``k3 = exp(lp_ref - lp) - (lp_ref - lp) - 1`` and the sampled-token entropy estimate ``H = -exp(lp) lp``;
    on every position of the ``[B, S-1]`` (or ``[1, bin-1]``) grid, masked later by ``loss_func``.
  - ``get_logprobs`` / ``selective_log_softmax`` -> :func:`token_logprobs`: ``log_softmax(logits)[t+1]`` at every
    position ``t < S-1``; the logits are never divided by the sampling temperature (``--rl-default-temperature``
    is read only where requests are sent to the inference engine).
  - ``prepare_data_for_update`` / ``compute_logprobs_batch`` -> :func:`stored_old_logprobs`: pi_old and pi_ref
    are kept in the training dtype (bf16 under ``--bf16``); the inference log-probs stay float32
    (``align_unpacked_inference_logprobs``, ``pack_inference_logprobs``).
* ``megatron/rl/sequence_packing_utils.py``: ``SequencePacker.pack_sequences`` / ``load_packed_data_by_index``
  -> :func:`pack_bins`: sequences, longest first, go into the open bin while it has room (else a new bin is
  opened: next-fit, though the source calls it first-fit) of ``bin_size`` tokens; a bin's ``seq_starts`` lists
  each sequence's start plus the end of the last one, ``seq_lengths`` the sequences' lengths; its loss mask is
  the generation mask shifted by one (``[1, bin_size - 1]``).
* ``train_rl.py``: ``forward_step`` -> :func:`forward_step` (call order: next item; unpack the 7-tuple or load the
  bin; ``loss_mask[:, 1:]``; forward -> log-probs; ``calculate_grpo_loss`` on the last pipeline stage; return the
  per-token loss and ``loss_func`` bound to the mask and the five logging tensors); ``loss_func`` ->
  :func:`loss_func`: ``(sum(loss * mask), max(n_tokens, 1), {'lm loss', 'rl/kl_term', 'rl/pi_over_pi_old',
  'rl/entropy_term', 'rl/truncated_from_above', 'rl/truncated_from_below'})``, every value a ``[sum, n_tokens]``
  pair.
* ``megatron/core/pipeline_parallel/schedules.py`` ``forward_step_calc_loss`` -> :func:`scheduled_loss`: a
  3-tuple loss is divided by its token count and by the number of micro-batches unless
  ``--calculate-per-token-loss`` (then the gradients are divided by the DP x CP token total in
  ``finalize_model_grads``); ``megatron/training/training.py`` ``train_step`` logs each ``[sum, count]`` key as
  ``sum / count`` over micro-batches and DP x CP (``tests/_megatron_lm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

RL_METRICS = ("rl/kl_term", "rl/pi_over_pi_old", "rl/entropy_term", "rl/truncated_from_above",
              "rl/truncated_from_below")


@dataclass(frozen=True)
class RLArgs:
    """The Megatron-LM flags the loss reads (``megatron/training/arguments.py`` defaults at d98e8a64dd)."""

    grpo_clamp_eps_lower: float = 0.01
    grpo_clamp_eps_upper: float = 0.01
    grpo_kl_beta: float = 0.001
    grpo_entropy_term_weight: float = 0.0
    rl_inference_logprobs_is_correction: bool = False
    rl_importance_sampling_truncation_coef: float | None = None
    rl_use_sequence_packing: bool = False
    calculate_per_token_loss: bool = False
    bf16: bool = False
    rl_default_temperature: float = 1.0


def grpo_loss(lp: Tensor, lp_old: Tensor, lp_ref: Tensor, adv: Tensor, args: RLArgs,
              lp_inf: Tensor | None = None, seq_starts: list[int] | None = None,
              seq_lengths: list[int] | None = None) -> tuple[Tensor, ...]:
    """``(loss, kl, rho, entropy, above, below)``, each ``[B, S-1]`` (packed: ``[1, bin-1]``).

    ``adv``: ``[B]`` one advantage per row, or (packed) ``[n_seq]`` spread over positions
    ``start .. start + length - 2`` of each sequence (0 elsewhere). ``lp_inf`` (correction on) enters the weight.
    """
    rho = torch.exp(lp - lp_old)
    lo, hi = 1 - args.grpo_clamp_eps_lower, 1 + args.grpo_clamp_eps_upper
    if seq_starts is not None:
        per_pos = torch.zeros_like(lp)
        for i, (start, length) in enumerate(zip(seq_starts, seq_lengths)):
            per_pos[0, start:min(start + length - 1, lp.shape[1])] = adv[i]
        adv = per_pos
    else:
        adv = adv.reshape(-1, 1)
    kl = torch.exp(lp_ref - lp) - (lp_ref - lp) - 1
    entropy = -torch.exp(lp) * lp
    w = is_weights(lp_old, lp_inf, args.rl_importance_sampling_truncation_coef)
    surrogate = torch.minimum(rho * adv, rho.clamp(lo, hi) * adv)
    loss = -w * surrogate + args.grpo_kl_beta * kl - args.grpo_entropy_term_weight * entropy
    return loss, kl, rho, entropy, rho > hi, rho < lo


def is_weights(lp_old: Tensor, lp_inf: Tensor | None, coef: float | None) -> Tensor:
    """``exp(lp_old - lp_inf)``, ``min(., coef)`` when ``coef`` is set; ``1`` without inference log-probs. No
    clamp: a log-ratio above ~88.7 overflows float32 to ``inf``. Mixed dtypes promote (bf16 pi_old - float32)."""
    if lp_inf is None:
        return torch.ones((), dtype=lp_old.dtype)
    w = torch.exp(lp_old - lp_inf)
    return w if coef is None else torch.minimum(w, torch.tensor(coef, dtype=lp_old.dtype))


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``[B, S-1]`` log-probability of token ``t+1`` under ``softmax(logits[:, t])`` (no temperature)."""
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def stored_old_logprobs(lp: Tensor, args: RLArgs) -> Tensor:
    """pi_old (and pi_ref) as ``prepare_data_for_update`` keeps them: in the training dtype."""
    return lp.to(torch.bfloat16) if args.bf16 else lp


def loss_func(loss_mask: Tensor, kl: Tensor, rho: Tensor, entropy: Tensor, above: Tensor, below: Tensor,
              per_token: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``(sum of masked loss, token count (>= 1), {key: [masked sum, token count]})``."""
    mask = loss_mask.float().reshape(-1)
    n = mask.sum().clamp(min=1.0)
    total = (per_token.float().reshape(-1) * mask).sum()
    pairs = {"lm loss": total.detach()}
    for key, t in zip(RL_METRICS, (kl, rho, entropy, above, below)):
        pairs[key] = (t.float().reshape(-1) * mask).sum().detach()
    return total, n.int(), {k: torch.stack([v, n]) for k, v in pairs.items()}


@dataclass
class Bin:
    """One packed bin as ``load_packed_data_by_index`` returns its parts (``[1, bin]`` / ``[1, bin - 1]``)."""

    tokens: Tensor
    position_ids: Tensor
    loss_mask: Tensor
    seq_starts: list[int]
    seq_lengths: list[int]
    seq_indices: list[int]


def pack_bins(tokens: Tensor, lengths: list[int], gen_mask: Tensor, bin_size: int, max_per_bin: int,
              pad: int = 0) -> list[Bin]:
    """Next-fit of the sequences, longest first, into bins of ``bin_size`` (``SequencePacker``, multiple 1)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    groups: list[list[int]] = []
    for i in order:
        if groups and sum(lengths[j] for j in groups[-1]) + lengths[i] <= bin_size \
                and len(groups[-1]) < max_per_bin:
            groups[-1].append(i)
        else:
            groups.append([i])
    bins = []
    for group in groups:
        toks = torch.full((1, bin_size), pad, dtype=tokens.dtype)
        pos = torch.zeros((1, bin_size), dtype=torch.long)
        mask = torch.zeros((1, bin_size))
        starts, at = [], 0
        for i in group:
            n = lengths[i]
            toks[0, at:at + n], pos[0, at:at + n] = tokens[i, :n], torch.arange(n)
            mask[0, at:at + n] = gen_mask[i, :n].float()
            starts.append(at)
            at += n
        bins.append(Bin(toks, pos, mask[:, 1:], starts + [at], [lengths[i] for i in group], group))
    return bins


def forward_step(item, logprobs_of, args: RLArgs, *, last_stage: bool = True):
    """One micro-batch as ``train_rl.forward_step`` runs it.

    ``item``: unpacked ``(tokens, adv, lp_old, loss_mask, position_ids, lp_ref, lp_inf)`` (``loss_mask``
    ``[B, S]``, the others ``[B, S-1]``; ``lp_inf`` zeros when the correction is off) or packed
    ``(bin, adv, lp_old, lp_ref, lp_inf)``. ``logprobs_of(tokens, position_ids)`` is the model forward +
    :func:`token_logprobs`. Returns ``(output, loss_func bound to the mask and the logging tensors)``.
    """
    if args.rl_use_sequence_packing:
        b, adv, lp_old, lp_ref, lp_inf = item
        tokens, pos, mask, starts, lengths = b.tokens, b.position_ids, b.loss_mask, b.seq_starts, b.seq_lengths
    else:
        tokens, adv, lp_old, mask, pos, lp_ref, lp_inf = item
        mask, starts, lengths = mask[:, 1:], None, None
    if not args.rl_inference_logprobs_is_correction:
        lp_inf = None
    lp = logprobs_of(tokens, pos)
    if not last_stage:
        return lp, partial(loss_func, mask, None, None, None, None, None)
    loss, kl, rho, entropy, above, below = grpo_loss(lp, lp_old, lp_ref, adv, args, lp_inf, starts, lengths)
    return loss, partial(loss_func, mask, kl, rho, entropy, above, below)


def scheduled_loss(total: Tensor, n_tokens: Tensor, num_microbatches: int, args: RLArgs) -> Tensor:
    """What the schedule backpropagates for one micro-batch's 3-tuple (before DP gradient averaging)."""
    if args.calculate_per_token_loss:
        return total
    return total / n_tokens.clamp(min=1) / num_microbatches
