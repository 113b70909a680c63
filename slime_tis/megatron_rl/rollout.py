"""Where Megatron-LM prepares the update (``rl_utils.prepare_data_for_update``; docs/megatron_rl.md, "Launch"):
the inference log-probs kept and checked per row (:func:`check_inference_log_probs`), the pi_old / pi_ref passes
through :meth:`RLHost.log_probs` or skipped, the training loader handed once to :meth:`RLHost.begin_rollout`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from slime_tis.engine.batch import cp_slice_padded
from slime_tis.engine.parallel import parallel_context
from slime_tis.megatron_rl.host import PackedBin, RLHost, row_grid

__all__ = ["RolloutHooks", "check_inference_log_probs", "final_turns", "install_rollout"]


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class RolloutHooks:
    """The wrapped ``prepare_data_for_update`` / ``compute_logprobs_batch`` of ``rl_utils`` (Megatron-LM's or a
    stand-in); ``host()`` returns the :class:`RLHost`, ``read_item`` turns a loader element into the item,
    ``args()`` returns Megatron-LM's arguments. ``forwards`` / ``skipped`` count the passes per role (``old``,
    ``ref``)."""

    def __init__(self, rl_utils: Any, host: Callable[[], RLHost], read_item: Callable[[Any], Any],
                 args: Callable[[], Any]) -> None:
        self.rl_utils, self.host, self.read_item, self.args = rl_utils, host, read_item, args
        self.forwards: Counter = Counter()
        self.skipped: Counter = Counter()
        self.rejected: Counter = Counter()  # rows marked by check_inference_log_probs: "missing", "length"
        self.appended = 0  # appended tokens check_inference_log_probs left out of the loss, all collections
        self._appended: int | None = None  # the current collection's (None: not checked, algorithm 0)
        self._calls: int | None = None  # compute_logprobs_batch calls inside prepare_data_for_update

    def _wrap_prepare(self, prepare: Callable) -> Callable:
        signature = inspect.signature(prepare)
        if "is_correction" not in signature.parameters:
            raise RuntimeError("slime_tis.megatron_rl: prepare_data_for_update has no 'is_correction' argument; "
                               "this Megatron-LM version is not supported")

        @functools.wraps(prepare)
        def prepare_data_for_update(*args, **kwargs):
            if self.host().cfg.algorithm != 0:  # the data must carry the inference log-probs (pi_rollout)
                self.args().rl_inference_logprobs_is_correction = True
                call = signature.bind(*args, **kwargs)
                call.arguments["is_correction"] = True
                args, kwargs = call.args, call.kwargs
            loaders: list = []
            rl = self.rl_utils

            def recorded(make):
                def make_and_record(*a, **k):
                    loaders.append(make(*a, **k))
                    return loaders[-1]
                return make_and_record

            self._calls, self._appended = 0, None
            trajectories = rl.prepare_trajectories
            if self.host().cfg.algorithm != 0:
                trajectories = self._checked_trajectories(trajectories)
            try:
                with _swapped(rl, "DataLoader", recorded(rl.DataLoader)), \
                        _swapped(rl, "get_microbatch_dataloader", recorded(rl.get_microbatch_dataloader)), \
                        _swapped(rl, "prepare_trajectories", trajectories):
                    out = prepare(*args, **kwargs)
            finally:
                self._calls = None
            if not loaders:
                raise RuntimeError("slime_tis.megatron_rl: prepare_data_for_update built no training DataLoader")
            iterator, *rest = out
            elements = self.host().begin_rollout([self.read_item(e) for e in loaders[-1]], appended=self._appended)
            return (type(iterator)(itertools.cycle(elements)), *rest)

        return prepare_data_for_update

    def _checked_trajectories(self, prepare_trajectories: Callable) -> Callable:
        """``prepare_trajectories`` returning the generation masks and log-probs :func:`check_inference_log_probs`
        checked."""
        signature = inspect.signature(prepare_trajectories)

        @functools.wraps(prepare_trajectories)
        def checked(*args, **kwargs):
            trajs, generation_masks, inference = prepare_trajectories(*args, **kwargs)
            rows = signature.bind(*args, **kwargs).arguments.get("rows")
            generation_masks, inference, counts = check_inference_log_probs(
                generation_masks, inference, self.host().cfg, final_turn=final_turns(rows, len(inference)))
            appended = counts.pop("appended", 0)
            self.rejected.update(counts)
            self.appended += appended
            self._appended = (self._appended or 0) + appended
            return trajs, generation_masks, inference

        return checked

    def _wrap_compute(self, compute: Callable) -> Callable:
        signature = inspect.signature(compute)
        for name in ("trajs_batch_size", "seq_length", "dtype", "is_correction"):
            if name not in signature.parameters:
                raise RuntimeError(f"slime_tis.megatron_rl: compute_logprobs_batch has no '{name}' argument; "
                                   "this Megatron-LM version is not supported")

        @functools.wraps(compute)
        def compute_logprobs_batch(*args, **kwargs):
            if self._calls is None:  # outside prepare_data_for_update: Megatron-LM's own pass
                return compute(*args, **kwargs)
            role = "old" if self._calls == 0 else "ref"
            self._calls += 1
            host = self.host()
            call = signature.bind(*args, **kwargs)
            a = call.arguments
            needed = host.cfg.needs_old_log_probs if role == "old" else host.cfg.kl_coef != 0.0
            if not needed:
                self.skipped[role] += 1
                return torch.zeros(a["trajs_batch_size"], a["seq_length"] - 1, dtype=a["dtype"])
            self.forwards[role] += 1
            a["dtype"] = torch.float32
            with _swapped(self.rl_utils, "logprobs_forward_step", self._logprobs_forward_step):
                return compute(*call.args, **call.kwargs)

        return compute_logprobs_batch

    def _logprobs_forward_step(self, data_iterator, model, is_correction, packing_context=None):
        """Megatron-LM's ``logprobs_forward_step`` through the host: ``([B, S-1] float32 log-probs, None)`` on the
        last pipeline stage, the model output elsewhere."""
        host = self.host()
        model.eval()
        if packing_context is not None:
            index = int(next(data_iterator)[0].item())  # host-sync-ok: the loader's bin index, before the forward
            b = PackedBin.of(self.rl_utils.load_packed_data_by_index(index, packing_context, is_correction))
            tokens, pos = b.tokens, b.position_ids
        else:
            tokens, pos = next(data_iterator)
            b = None
        if host.device is not None:
            tokens, pos = tokens.to(host.device), pos.to(host.device)
        ctx = parallel_context()
        if b is None and ctx.cp_size > 1:  # this CP rank's part of the rows; the parts gathered back
            labels = cp_slice_padded(row_grid(tokens[:, 1:]), ctx.cp_size, ctx.cp_rank)
            tokens_in, pos_in = (cp_slice_padded(x, ctx.cp_size, ctx.cp_rank) for x in (tokens, pos))
        else:
            labels, tokens_in, pos_in = tokens[:, 1:], tokens, pos
        with torch.no_grad():
            output = host.model_forward(model, tokens_in, pos_in, b)
        model.train()
        if not ctx.last_pp_stage:
            return output, None
        lp, _ = host.log_probs(output, labels.reshape(-1).to(torch.int64), local=tokens_in is not tokens)
        if tokens_in is tokens:
            return lp.view(tokens.shape[0], tokens.shape[1] - 1), None
        from megatron.core import parallel_state as ps

        full = _gather_rows(lp.view(labels.shape), ctx.cp_size, ps.get_context_parallel_group())
        return full[:, :-1].contiguous(), None


def _gather_rows(local: Tensor, cp_size: int, group) -> Tensor:
    """``[B, S]`` whole rows from every CP rank's ``cp_slice_padded`` part ``[B, S / cp]`` (rank ``r`` holds
    chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``; no gradient: the pi_old / pi_ref passes)."""
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    b, c = local.shape[0], local.shape[1] // 2
    full = local.new_empty(b, 2 * cp_size, c, *local.shape[2:])
    for r, part in enumerate(parts):
        full[:, r], full[:, 2 * cp_size - 1 - r] = part[:, :c], part[:, c:]
    return full.reshape(b, 2 * cp_size * c, *local.shape[2:])


def final_turns(rows: Any, n: int) -> list[bool] | None:
    """Per output row of ``prepare_trajectories``, whether its last generated token ends its rollout's final turn
    (``rows`` entries ``(rollout, turn index)``); ``None`` where ``rows`` is not one entry per row (all do)."""
    if not isinstance(rows, (list, tuple)) or len(rows) != n:
        return None
    return [not (isinstance(r, tuple) and len(r) == 2 and hasattr(r[0], "trajectory"))
            or int(r[1]) == len(r[0].trajectory) - 1 for r in rows]


def check_inference_log_probs(generation_masks: Tensor, inference: list, cfg: Any,
                              final_turn: list[bool] | None = None) -> tuple[Tensor, list, Counter]:
    """Each row's inference log-probs (one 1-D tensor or ``None`` per row, in generated-token order) against its
    ``g`` generated tokens (``generation_masks [N, S]`` bool), before Megatron-LM places them: ``g`` log-probs are
    kept; ``g - 1`` where the last generated token ends the final turn (``final_turn``; ``None``: all do) clears
    that appended token from the mask (``"appended"``); any other count (``"missing"``, ``"length"``) becomes
    ``g`` values of ``-inf``, so the core rejects the sequence as non-finite. Returns ``(masks, rows, counts)``;
    one-line ``ValueError`` where no row with generated tokens carries any (docs/megatron_rl.md, "Launch")."""
    counts: Counter = Counter()
    masks = generation_masks.reshape(len(inference), -1)
    generated = [int(g) for g in masks.sum(1)]  # host-sync-ok: rollout prep
    out, cleared = [], []
    for i, (g, lp) in enumerate(zip(generated, inference)):
        n = 0 if lp is None else int(lp.numel())
        if 0 < n == g - 1 and (final_turn is None or final_turn[i]):
            counts["appended"] += 1
            cleared.append(i)
        elif g > 0 and n != g:
            counts["missing" if n == 0 else "length"] += 1
            lp = torch.full((g,), float("-inf"), dtype=torch.float32)
        out.append(lp)
    rows = sum(g > 0 for g in generated)
    if rows and counts["missing"] == rows:
        flag = {1: "--use-rollout-log-probs", 2: "--use-tis", 3: "--use-tis --use-rollout-log-probs"}[cfg.algorithm]
        raise ValueError(f"{flag} (algorithm {cfg.algorithm}) reads the inference log-probs, but none of the "
                         f"rollouts' {rows} sequences with generated tokens carries any: return per-token log-probs "
                         "from the inference engine, or train without --use-tis / --use-rollout-log-probs")
    if cleared:
        masks = masks.clone()
        for i in cleared:
            masks[i, int(masks[i].nonzero()[-1])] = False  # host-sync-ok: rollout prep
        generation_masks = masks.reshape(generation_masks.shape)
    return generation_masks, out, counts


def install_rollout(rl_utils: Any, host: Callable[[], RLHost], read_item: Callable[[Any], Any],
                    args: Callable[[], Any]) -> RolloutHooks:
    """Wrap ``rl_utils``' ``prepare_data_for_update`` and ``compute_logprobs_batch``; returns the hooks."""
    if not callable(getattr(rl_utils, "prepare_trajectories", None)):
        raise RuntimeError("slime_tis.megatron_rl: rl_utils has no prepare_trajectories; this Megatron-LM "
                           "version is not supported")
    hooks = RolloutHooks(rl_utils, host, read_item, args)
    rl_utils.prepare_data_for_update = hooks._wrap_prepare(rl_utils.prepare_data_for_update)
    rl_utils.compute_logprobs_batch = hooks._wrap_compute(rl_utils.compute_logprobs_batch)
    return hooks
