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
  - ``prepare_trajectories`` -> ``RLUtils.prepare_trajectories``: per row the tokens, the generation mask and
    the generated tokens' inference log-probs as the rollout carried them (``None`` for none), before padding.
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

import itertools
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

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


# --- where the update is prepared: ``rl_utils.prepare_data_for_update`` and its log-prob passes -------------------


@dataclass
class PackingContext:
    """The packed collection (``sequence_packing_utils.PackingContext``): ``packed_trajs`` /
    ``packed_position_ids`` ``[n_bins, bin]``, ``packed_loss_mask`` ``[n_bins, bin]`` (the generation mask),
    per-bin ``seq_starts`` (starts plus end), ``seq_lengths``, ``bin_seq_indices``, ``bin_advantages``; the
    log-prob grids ``[n_bins, bin - 1]`` are added once computed."""

    packed_trajs: Tensor
    packed_position_ids: Tensor
    packed_loss_mask: Tensor
    seq_starts: list
    seq_lengths: list
    bin_seq_indices: list
    bin_advantages: list
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    packed_inference_logprobs: Tensor | None = None


class RuntimeState:
    """``get_rl_runtime_state()``: the packing context and the trained-sequence count."""

    def __init__(self) -> None:
        self.packing_context: PackingContext | None = None
        self.sequences = 0

    def increment_sequences(self, n: int) -> None:
        self.sequences += int(n)


class ReplayIterator:
    """``RerunDataIterator``: ``next`` of the wrapped iterable (replay not modelled)."""

    def __init__(self, iterable) -> None:
        self.iterable = iterable

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.iterable)


class RLUtils:
    """The parts of ``megatron/rl/rl_utils.py`` (and the packing helpers it imports) that prepare the update, as
    methods that find each other through ``self`` (the module's globals: a host may replace any of them).

    ``prepare_data_for_update(model, ref_state_dict, rollout, sequence_packing, is_correction)``: with ``dtype`` the
    training dtype (bf16 under ``--bf16``): advantages in ``dtype``; the log-prob loader (``DataLoader`` over
    ``(tokens, position_ids)`` rows, or over bin indices, batch 1); pi_old = ``compute_logprobs_batch(...)`` (first
    call), then the reference weights loaded and pi_ref = ``compute_logprobs_batch(...)`` (second call), both in
    ``dtype``; the inference log-probs scattered in float32 onto the grid (unpacked: onto a float32 copy of pi_old,
    so slots the engine did not report keep pi_old; packed: onto zeros); the training loader (``DataLoader`` over
    the 7 row tensors, the inference row zeros unless ``is_correction`` and ``--rl-inference-logprobs-is-correction``,
    or ``get_microbatch_dataloader`` over bin indices); returns ``(RerunDataIterator(cycle(
    loader)), group stats, example groups)``. ``rollout``: ``tokens [N, S]``, ``gen_mask [N, S]`` bool,
    ``lengths``, ``inference`` (one float32 tensor per row, the generated tokens' log-probs; empty, ``None`` or
    the key absent: none), ``advantages [N]``; the rows come through :meth:`prepare_trajectories`.
    """

    DataLoader = DataLoader
    RerunDataIterator = ReplayIterator

    def __init__(self, args, micro_batch_size: int = 1, bin_size: int = 16, max_per_bin: int = 3) -> None:
        self.args, self.mbs, self.bin_size, self.max_per_bin = args, micro_batch_size, bin_size, max_per_bin
        self.state = RuntimeState()

    def get_rl_runtime_state(self) -> RuntimeState:
        return self.state

    def get_forward_backward_func(self):
        """The forward-only schedule of one micro-batch: ``[output]`` where ``loss_func`` is ``None``."""
        def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, forward_only, **kw):
            assert forward_only and num_microbatches == 1
            output, loss_func = forward_step_func(data_iterator, model)
            assert loss_func is None
            return [output]
        return forward_backward

    def get_microbatch_dataloader(self, n_bins: int, micro_batch_size: int):
        return DataLoader(TensorDataset(torch.arange(n_bins)), batch_size=micro_batch_size,
                          collate_fn=lambda x: x[0])

    def load_packed_data_by_index(self, i: int, ctx: PackingContext, is_correction: bool) -> tuple:
        """The bin's 11 parts; a log-prob grid not computed yet (during the passes) is ``None``."""
        s = slice(i, i + 1)
        old, ref, inf = (None if t is None else t[s] for t in (ctx.old_logprobs, ctx.ref_logprobs,
                                                               ctx.packed_inference_logprobs))
        return (ctx.packed_trajs[s], ctx.bin_advantages[i], old, ctx.packed_loss_mask[s, 1:],
                ctx.packed_position_ids[s], ref, inf if is_correction else None, ctx.seq_starts[i],
                ctx.seq_lengths[i], ctx.bin_seq_indices[i], None)

    def logprobs_forward_step(self, data_iterator, model, is_correction, packing_context=None):
        model.eval()
        if packing_context is not None:
            parts = self.load_packed_data_by_index(int(next(data_iterator)[0]), packing_context, is_correction)
            tokens, pos = parts[0], parts[4]
        else:
            tokens, pos = next(data_iterator)
        with torch.no_grad():
            lp = token_logprobs(model(tokens, pos, None), tokens)
        model.train()
        return stored_old_logprobs(lp, self.args), None

    def compute_logprobs_batch(self, model, data_loader, forward_backward_func, packing_context, trajs_batch_size,
                               seq_length, logprobs_batch_size, decoder_seq_length, dtype, pp_group, is_correction,
                               collect_non_loss_data=False):
        it, out = iter(data_loader), []
        for _ in range(len(data_loader)):
            out.append(forward_backward_func(
                forward_step_func=partial(self.logprobs_forward_step, is_correction=is_correction,
                                          packing_context=packing_context),
                data_iterator=it, model=model, num_microbatches=1, forward_only=True)[0].detach())
        lp = torch.cat(out, 0)
        assert lp.dtype == dtype and lp.shape == (trajs_batch_size, seq_length - 1)
        return lp.cpu()

    def prepare_trajectories(self, rollout: dict) -> tuple[Tensor, Tensor, list[Tensor | None]]:
        """``(tokens [N, S], generation masks [N, S] bool, inference log-probs)``: one float32 tensor per row, the
        generated tokens' log-probs as the rollout carried them (unpadded), or ``None`` where it carried none
        (``rl_utils.prepare_trajectories``: ``torch.Tensor(lps) if lps else None``)."""
        inference = rollout.get("inference") or [None] * rollout["tokens"].shape[0]
        rows = [None if lp is None or len(lp) == 0 else torch.as_tensor(lp, dtype=torch.float32) for lp in inference]
        return rollout["tokens"], rollout["gen_mask"], rows

    def prepare_data_for_update(self, model, ref_state_dict, rollout, sequence_packing, is_correction):
        dtype = torch.bfloat16 if self.args.bf16 else torch.float32
        tokens, gen, inference = self.prepare_trajectories(rollout)
        lengths = rollout["lengths"]
        n, seq = tokens.shape
        adv = rollout["advantages"].to(dtype)
        ctx = None
        if sequence_packing:
            bins = pack_bins(tokens, lengths, gen, self.bin_size, self.max_per_bin)
            ctx = PackingContext(torch.cat([b.tokens for b in bins]), torch.cat([b.position_ids for b in bins]),
                                 torch.cat([torch.cat([torch.zeros(1, 1), b.loss_mask], 1) for b in bins]),
                                 [b.seq_starts for b in bins], [b.seq_lengths for b in bins],
                                 [b.seq_indices for b in bins], [adv[b.seq_indices] for b in bins])
            self.state.packing_context = ctx
            loader = self.DataLoader(TensorDataset(torch.arange(len(bins))), batch_size=1)
            rows, width, batch = len(bins), self.bin_size, 1
        else:
            pos = torch.arange(seq).expand(n, seq).contiguous()
            loader = self.DataLoader(TensorDataset(tokens, pos), batch_size=self.mbs)
            rows, width, batch = n, seq, self.mbs
        kw = dict(forward_backward_func=self.get_forward_backward_func(), packing_context=ctx,
                  trajs_batch_size=rows, seq_length=width, logprobs_batch_size=batch, decoder_seq_length=None,
                  dtype=dtype, pp_group=None, is_correction=is_correction)
        old = self.compute_logprobs_batch(model=model, data_loader=loader, **kw)
        current = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(ref_state_dict)
        ref = self.compute_logprobs_batch(model=model, data_loader=loader, **kw)
        model.load_state_dict(current)
        if sequence_packing:
            ctx.old_logprobs, ctx.ref_logprobs = old, ref
            inf = torch.zeros(rows, width - 1)
            for k, group in enumerate(ctx.bin_seq_indices):
                for i, start in zip(group, ctx.seq_starts[k]):
                    _scatter_inference(inf[k], inference[i], gen[i], start, start + lengths[i] - 1)
            ctx.packed_inference_logprobs = inf
            loader = self.get_microbatch_dataloader(rows, self.mbs)
        else:
            inf = old.clone().float()
            for i in range(n):
                _scatter_inference(inf[i], inference[i], gen[i], 0, seq - 1)
            keep = is_correction and self.args.rl_inference_logprobs_is_correction
            data = [tokens, adv, old, gen.float(), pos, ref, inf if keep else torch.zeros_like(old)]
            loader = self.DataLoader(TensorDataset(*data), batch_size=self.mbs)
        return self.RerunDataIterator(itertools.cycle(loader)), None, None


def _scatter_inference(row: Tensor, values: Tensor | None, gen: Tensor, start: int, end: int) -> None:
    """The log-prob of generated token ``p`` goes to slot ``start + p - 1`` (kept within ``[start, end)``); the
    ``k``-th log-prob to the ``k``-th generated token, as many as both have: generated tokens past the last
    log-prob keep the slot's value (unpacked: pi_old; packed: 0). A row without log-probs is skipped (packed:
    ``pack_inference_logprobs``; the commit's unpacked ``align_unpacked_inference_logprobs`` raises a
    ``TypeError`` there instead)."""
    if values is None:
        return
    target = start + gen.nonzero().flatten() - 1
    k = min(values.numel(), target.numel())
    target, values = target[:k], values[:k]
    ok = (target >= start) & (target < end)
    row[target[ok]] = values[ok].float()
