"""The ``train_rl.py`` host: Megatron-LM's RL micro-batches (docs/megatron_rl.md, "What Megatron-LM hands the
loss") -> one packed ``TISBatch`` of ``T = B (S-1)`` (``L-1``) positions (``labels = tokens[:, 1:]``, the loss mask
shifted by one and in a bin restricted to each sequence's positions, one advantage per sequence, float32
log-probs), its ``forward_step`` -> the step engine and the schedule contract's form
(``slime_tis.engine.megatron_schedule``: ``lm loss``, then every step metric as ``[value, 1]``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_tis.arguments import add_tis_arguments
from slime_tis.config import TISConfig
from slime_tis.engine.batch import TISBatch, cp_slice_padded
from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
from slime_tis.engine.megatron_schedule import add_metrics_to_loss_dicts, loss_form_for
from slime_tis.engine.parallel import parallel_context
from slime_tis.engine.step import StepEngine
from slime_tis.engine.totals import step_batch_norm
from slime_tis.megatron_rl.flags import config_from_megatron_rl_args, record_typed_flags, resolve_megatron_rl_flags

__all__ = ["APPENDED_METRIC", "RLHost", "RolloutIndex", "add_megatron_rl_tis_arguments",
           "config_from_megatron_rl_args", "item_to_batch", "refuse_context_parallel", "refuse_interleaved_pipeline"]


#: the collection's tokens (all DP ranks) appended by the training side without an inference log-prob, left out
#: of the loss; logged where the launcher checked the inference log-probs (algorithms 1-3)
APPENDED_METRIC = "tis/appended_tokens"


def add_megatron_rl_tis_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags on Megatron-LM's parser, recording the mapped flags typed (``flags.record_typed_flags``);
    ``--tis-routing-replay`` is declared so that it is refused with its reason, not as unknown. Returns it."""
    parser = add_tis_arguments(parser)
    if not any("--tis-routing-replay" in a.option_strings for a in parser._actions):
        parser.add_argument("--tis-routing-replay", action="store_true",
                            help="Refused by this host: Megatron-LM's RL loop hands the trainer no routed experts.")
    return record_typed_flags(parser)


#: Megatron-LM's arguments that select an interleaved (virtual) pipeline schedule
_VIRTUAL_PIPELINE_ARGS = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                          "virtual_pipeline_model_parallel_size")


def refuse_interleaved_pipeline(args: Any) -> None:
    """One-line ``ValueError`` naming the flag and value where the arguments select an interleaved pipeline."""
    for attr in _VIRTUAL_PIPELINE_ARGS:
        value = getattr(args, attr, None)
        if value is not None and not (attr == "virtual_pipeline_model_parallel_size" and int(value) <= 1):
            raise ValueError(f"--{attr.replace('_', '-')} {value}: slime_tis.megatron_rl does not run interleaved "
                             "(virtual) pipeline schedules; drop the flag (plain pipeline parallelism is supported)")


def refuse_context_parallel(cp: Any, *, packed: bool) -> None:
    """One-line ``ValueError`` for ``--context-parallel-size`` above 1 with sequence-packed bins."""
    if packed and cp is not None and int(cp) > 1:
        raise ValueError(f"--context-parallel-size {cp} with --rl-use-sequence-packing: slime_tis.megatron_rl "
                         "splits unpacked rows across context-parallel ranks, not packed bins; use "
                         "--no-rl-use-sequence-packing or --context-parallel-size 1")


def _f32(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.reshape(-1).to(torch.float32)


def row_grid(x: Tensor) -> Tensor:
    """``[B, S-1]`` (per log-prob position) -> ``[B, S]`` aligned with the tokens, a zero last column."""
    return torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)


def item_to_batch(item: tuple, cfg: TISConfig, *, packed: bool, cp: tuple[int, int] = (1, 0)
                  ) -> tuple[TISBatch, Tensor, Tensor, Any]:
    """``(TISBatch, tokens, position_ids, bin or None)`` of one item; unpacked rows under context parallelism
    (``cp = (size, rank)``): this rank's ``cp_slice_padded`` part."""
    if packed:
        if len(item) == 11:  # load_packed_data_by_index's parts
            item = (PackedBin.of(item), item[1], item[2], item[5], item[6])
        b, adv, old, ref, inf = item
        tokens, pos, mask = b.tokens, b.position_ids, b.loss_mask.reshape(-1)
        t = mask.shape[0]
        starts, lengths = [int(s) for s in b.seq_starts], [int(n) for n in b.seq_lengths]
        owned = torch.zeros(t, dtype=torch.bool, device=mask.device)
        for s, n in zip(starts, lengths):
            owned[s:min(s + n - 1, t)] = True
        cu = torch.tensor([0, *[min(s, t) for s in starts[1:len(lengths)]], t], dtype=torch.int64,
                          device=mask.device)
        mask = mask * owned
        if lengths:
            adv_tok = torch.repeat_interleave(adv.reshape(-1).to(torch.float32), cu.diff())
        else:  # a padding bin (Megatron-LM evens the bins over DP ranks): one span, nothing trains
            adv_tok = torch.zeros(t, dtype=torch.float32, device=mask.device)
    elif cp[0] > 1:
        return _cp_rows_to_batch(item, cfg, *cp)
    else:
        tokens, adv, old, mask, pos, ref, inf = item
        rows, t_row = tokens.shape[0], tokens.shape[1] - 1
        mask = mask[:, 1:].reshape(-1)
        cu = torch.arange(rows + 1, dtype=torch.int64, device=mask.device) * t_row
        adv_tok = adv.reshape(-1, 1).to(torch.float32).expand(rows, t_row).reshape(-1)
        b = None
    return _batch(cfg, tokens[:, 1:], mask, adv_tok, cu, old, ref, inf, _f32), tokens, pos, b


def _batch(cfg: TISConfig, labels: Tensor, mask: Tensor, adv: Tensor, cu: Tensor, old: Tensor | None,
           ref: Tensor | None, inf: Tensor | None, log_probs: Callable) -> TISBatch:
    """The ``TISBatch``, with ``log_probs`` of the inference / old / reference log-probs the configuration reads."""
    return TISBatch(labels=labels.reshape(-1).to(torch.int64), loss_mask=mask, advantages=adv, cu_seqlens=cu,
                    rollout_log_probs=log_probs(inf) if cfg.algorithm != 0 else None,
                    old_log_probs=log_probs(old) if cfg.needs_old_log_probs else None,
                    ref_log_probs=log_probs(ref) if cfg.kl_coef else None)


def _cp_rows_to_batch(item: tuple, cfg: TISConfig, cp_size: int, cp_rank: int
                      ) -> tuple[TISBatch, Tensor, Tensor, None]:
    """Unpacked rows ``[B, S]`` -> this CP rank's ``[B, S / cp]`` part of the tokens, position ids and row-aligned
    ``TISBatch`` (position ``t`` predicts ``tokens[:, t + 1]``; the last one masked)."""
    tokens, adv, old, mask, pos, ref, inf = item
    rows = tokens.shape[0]
    def part(x: Tensor) -> Tensor:
        return cp_slice_padded(x, cp_size, cp_rank)

    def grid(x: Tensor | None) -> Tensor | None:
        return None if x is None else _f32(part(row_grid(x.reshape(rows, -1).to(torch.float32))))

    labels = part(row_grid(tokens[:, 1:]))
    cu = torch.arange(rows + 1, dtype=torch.int64, device=tokens.device) * labels.shape[1]
    adv_tok = part(adv.reshape(-1, 1).to(torch.float32).expand(tokens.shape)).reshape(-1)
    return _batch(cfg, labels, grid(mask[:, 1:]), adv_tok, cu, old, ref, inf, grid), part(tokens), part(pos), None


@dataclass(frozen=True)
class RolloutIndex:
    """A training iterator element: micro-batch ``k`` of the collection :meth:`RLHost.begin_rollout` translated."""

    k: int


@dataclass
class PackedBin:
    """One bin's parts (``load_packed_data_by_index``): ``tokens``, ``position_ids`` ``[1, L]``, ``loss_mask``
    ``[1, L-1]``, sequence starts / lengths / indices, ``packed_seq_params`` (THD attention)."""

    tokens: Tensor
    position_ids: Tensor
    loss_mask: Tensor
    seq_starts: Any
    seq_lengths: Any
    seq_indices: Any = None
    packed_seq_params: Any = None

    @classmethod
    def of(cls, parts: tuple) -> PackedBin:
        """The bin of ``load_packed_data_by_index``'s 11 parts."""
        return cls(parts[0], parts[4], parts[3], *parts[7:11])


def block_causal_mask(b) -> Tensor:
    """``[1, 1, L, L]`` bool attention mask of a packed bin (True = masked): causal within each sequence."""
    n = b.tokens.shape[1]
    seg = torch.full((n,), -1, dtype=torch.int64)
    for i, (s, length) in enumerate(zip(b.seq_starts, b.seq_lengths)):
        seg[int(s):int(s) + int(length)] = i
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return ~(same & causal)[None, None].to(b.tokens.device)


def unpacked_seq_params(tokens: Tensor):
    """``train_rl.forward_step``'s ``packed_seq_params`` for unpacked rows: THD, ``cu_seqlens = [0, S]``, no
    ``total_tokens``."""
    from dataclasses import fields

    from megatron.core.packed_seq_params import PackedSeqParams

    s = tokens.shape[1]
    cu = torch.tensor([0, s], dtype=torch.int32, device=tokens.device)
    extra = {"pad_between_seqs": False} if "pad_between_seqs" in {f.name for f in fields(PackedSeqParams)} else {}
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s,
                           **extra)


def default_model_forward(model, tokens: Tensor, pos: Tensor, b) -> Tensor:
    """The model call of ``train_rl.forward_step``: one unpacked row with :func:`unpacked_seq_params` (several rows
    get none: Megatron-LM's THD attention takes the batch dimension for a dummy one), a bin with its
    ``packed_seq_params`` or, without them (CPU local attention), a block-causal mask."""
    if b is None:
        if tokens.shape[0] == 1 and parallel_context().cp_size == 1:
            return model(tokens, pos, None, packed_seq_params=unpacked_seq_params(tokens))
        return model(tokens, pos, None)
    psp = getattr(b, "packed_seq_params", None)
    if psp is not None:
        return model(tokens, pos, None, packed_seq_params=psp)
    return model(tokens, pos, block_causal_mask(b))


class RLHost:
    """``train_rl.forward_step`` on the step engine. ``num_microbatches``: ``M`` or a callable (Megatron-LM's
    ``get_num_microbatches``); ``packed``, ``temperature``, ``per_token``: ``--rl-use-sequence-packing``,
    ``--rl-default-temperature``, ``--calculate-per-token-loss``; ``sampled_entropy``: the entropy term is
    ``-exp(lp) lp``; ``model_forward(model, tokens, position_ids, bin) -> logits``; ``read_item``: iterator element
    -> item; ``on_sequences``: called with each micro-batch's sequence count; ``device``: where translated
    micro-batches are kept."""

    def __init__(self, cfg: TISConfig, num_microbatches: int | Callable[[], int], *, packed: bool = False,
                 temperature: float = 1.0, per_token: bool = False, sampled_entropy: bool = False,
                 model_forward: Callable = default_model_forward, read_item: Callable = lambda x: x,
                 on_sequences: Callable[[int], None] = lambda n: None, device: Any = None) -> None:
        if not temperature > 0:
            raise ValueError(f"--rl-default-temperature must be > 0, got {temperature}")
        self.cfg, self.packed, self.temperature, self.per_token = cfg, packed, float(temperature), per_token
        self.sampled_entropy, self.model_forward, self.read_item = sampled_entropy, model_forward, read_item
        self.on_sequences, self.device = on_sequences, device
        self._m = num_microbatches if callable(num_microbatches) else (lambda: num_microbatches)
        self.steps, self.metrics = 0, {}
        self._queue: list = []
        self._rollout: list | None = None
        self.rollout_factor: Tensor | None = None
        self.appended: int | None = None

    @classmethod
    def from_args(cls, args: Any, num_microbatches: int | Callable[[], int], **kw) -> RLHost:
        """From Megatron-LM's parsed arguments (``megatron.training.get_args()``)."""
        refuse_interleaved_pipeline(args)
        packed = bool(getattr(args, "rl_use_sequence_packing", False))
        refuse_context_parallel(getattr(args, "context_parallel_size", 1), packed=packed)
        flags = resolve_megatron_rl_flags(args)
        return cls(flags.cfg, num_microbatches, packed=packed,
                   temperature=float(getattr(args, "rl_default_temperature", 1.0) or 1.0),
                   per_token=bool(getattr(args, "calculate_per_token_loss", False)),
                   sampled_entropy=flags.sampled_entropy, **kw)

    def _translate(self, item) -> tuple[TISBatch, Tensor, Tensor, Any, int]:
        """``item_to_batch`` on the host's device, with the item's sequence count (Megatron-LM's)."""
        ctx = parallel_context()
        batch, tokens, pos, b = item_to_batch(item, self.cfg, packed=self.packed, cp=(ctx.cp_size, ctx.cp_rank))
        n_seq = len(b.seq_lengths) if b is not None else int(tokens.shape[0])
        if self.device is None:
            return batch, tokens, pos, b, n_seq
        return batch.to(self.device), tokens.to(self.device), pos.to(self.device), b, n_seq

    def begin_rollout(self, items: list, appended: int | None = None) -> list[RolloutIndex]:
        """A new rollout collection (this rank's items in the training iterator's order): each translated once for
        every optimizer step on it, algorithm 2's batch-normalisation factor over all of it (one ``engine.begin``
        on the last stage). ``appended``: this rank's count for :data:`APPENDED_METRIC` (``None``: unchecked).
        Returns the training iterator's elements."""
        ctx = parallel_context()
        refuse_context_parallel(ctx.cp_size, packed=self.packed)
        self._rollout = [self._translate(item) for item in items]
        self.rollout_factor, self.appended = None, appended
        if ctx.last_pp_stage and step_batch_norm(self.cfg):
            totals = StepEngine(self.cfg, ctx.reducer).begin([r[0] for r in self._rollout])
            self.rollout_factor = totals.batch_norm_factor
        return [RolloutIndex(k) for k in range(len(self._rollout))]

    def _begin_step(self, data_iterator, chunk) -> None:
        """The step's ``M`` items (translated, or the collection's) and ``engine.begin`` on the last stage."""
        ctx = parallel_context()
        refuse_context_parallel(ctx.cp_size, packed=self.packed)
        self.ctx, self.dicts, items = ctx, [], []
        for _ in range(self._m()):
            element = next(data_iterator)
            if isinstance(element, RolloutIndex) and self._rollout is None:
                raise RuntimeError("RLHost: a RolloutIndex before begin_rollout")
            item = (self._rollout[element.k] if isinstance(element, RolloutIndex)
                    else self._translate(self.read_item(element)))
            self.on_sequences(item[4])
            items.append(item)
        self.form = loss_form_for([chunk], len(items), per_token=self.per_token)
        self.engine = StepEngine(self.cfg, ctx.reducer) if ctx.last_pp_stage else None
        if self.engine is not None:
            self.engine.begin([it[0] for it in items])
            if self.rollout_factor is not None:  # the collection's, decided in begin_rollout
                self.engine.totals.batch_norm_factor = self.rollout_factor
        self._queue = items

    def forward_step(self, data_iterator, model, *args, **kwargs):
        """Megatron-core's ``forward_step_func``: ``(output, loss_func)`` for the next micro-batch."""
        if isinstance(model, list) and len(model) > 1:
            raise ValueError(f"a model of {len(model)} virtual pipeline stages: slime_tis.megatron_rl does not run "
                             "interleaved pipeline schedules")
        chunk = model[0] if isinstance(model, list) else model
        if not self._queue:
            self._begin_step(data_iterator, chunk)
        batch, tokens, pos, b, _ = self._queue.pop(0)
        output = self.model_forward(chunk, tokens, pos, b)
        if self.engine is None:
            return output, lambda out, *a, **k: (out.sum() * 0.0, {})
        return output, self._loss_func(batch, last=not self._queue)

    def log_probs(self, output: Tensor, labels: Tensor, *, with_entropy: bool = False, local: bool = False
                  ) -> tuple[Tensor, Tensor | None]:
        """``(lp, entropy | None)`` float32 of ``labels`` (``tokens[:, 1:]`` flat) under
        ``softmax(output[:, :-1] / T)``; ``local``: a CP rank's part, one label per position, under
        ``softmax(output / T)``. The loss and the pi_old / pi_ref passes take their log-probs here."""
        logits = (output if local else output[:, :-1]).reshape(-1, output.shape[-1])
        return vocab_parallel_log_probs_and_entropy(logits, labels, temperature=self.temperature,
                                                    with_entropy=with_entropy)

    def _loss_func(self, batch: TISBatch, last: bool) -> Callable:
        def loss_func(output: Tensor, *args, **kwargs):
            lp, h = self.log_probs(output, batch.labels, with_entropy=not self.sampled_entropy,
                                   local=self.ctx.cp_size > 1 and not self.packed)
            entropy = -torch.exp(lp) * lp if self.sampled_entropy else h  # Megatron-LM's sampled-token estimate
            out = self.engine.loss(batch, lp, entropy=entropy)
            self.engine.record(out.stats)
            d = {"lm loss": self.form.loss_pair(out.loss.float())}
            self.dicts.append(d)
            if last:
                self._end_step()
            return self.form.returns(out.loss, self.engine.totals.num_tokens, batch.loss_mask, d)

        return loss_func

    def _end_step(self) -> None:
        """The step's metrics and :data:`APPENDED_METRIC` (summed over ranks) into the micro-batches' dicts."""
        self.metrics = self.engine.end(step=self.steps)
        self.steps += 1
        add_metrics_to_loss_dicts(self.dicts, self.metrics)
        if self.appended is not None:
            device = self.dicts[0]["lm loss"].device
            pair = self.form.rank_sum_pair(torch.tensor(float(self.appended), dtype=torch.float32, device=device))
            for d in self.dicts:
                d[APPENDED_METRIC] = pair
