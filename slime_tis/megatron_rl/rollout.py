"""Where Megatron-LM prepares the update (``megatron/rl/rl_utils.py`` ``prepare_data_for_update``): the host's
pi_old and pi_ref, and the rollout collection.

``prepare_data_for_update`` computes pi_old, then pi_ref (after loading the reference weights), each with one
call of ``compute_logprobs_batch`` (a forward-only pass over the collection), and returns a cycling iterator over
the collection's training micro-batches. :func:`install_rollout` wraps both functions in the module:

* the inference log-probs: where the algorithm reads them (1, 2, 3), Megatron-LM is told to keep them in the
  data (``is_correction`` and ``args.rl_inference_logprobs_is_correction`` set: Megatron-LM's own loss, their
  other reader, does not run under the host);
* the rows' inference log-probs (algorithms 1-3): ``rl_utils.prepare_trajectories``, which returns them per row
  before Megatron-LM pads and places them, is wrapped for the call; :func:`check_inference_log_probs` compares
  each row's count with its generated tokens: a row one short at its last generated token (a token the training
  side appended, e.g. the end-of-document token, that the inference engine did not sample) has that token cleared
  from the generation mask the call returns, from which Megatron-LM builds the loss mask and aligns the log-probs,
  so it leaves the loss and the rest of the row trains; a row that carries none, or any other number, gets
  ``-inf`` on every generated token (the core then rejects the sequence as non-finite and counts it); a collection
  in which no row carries any is refused;
* pi_old (the first call): algorithms 1 and 3 (``--use-rollout-log-probs``) anchor on the inference log-probs
  and need none, so the pass is skipped and zeros stand in (Megatron-LM's own train/inference comparison, which it
  logs from pi_old, then compares zeros); algorithms 0 and 2 take it through the host's log-prob path
  (:meth:`RLHost.log_probs`: float32, the sampling temperature applied), kept in float32;
* pi_ref (the second call): the same path where the KL term is on (``--tis-kl-coef`` /
  ``--grpo-kl-beta``), skipped (zeros) where it is 0;
* the collection: the training ``DataLoader`` the function builds (the last one made through the module's
  ``DataLoader``, or ``get_microbatch_dataloader`` for packed bins) is read once, the host translates every
  micro-batch (:meth:`RLHost.begin_rollout`: the collection's batch-normalisation
  factor, reduced over DP) and the function returns a cycling iterator of the same type over the host's
  :class:`~slime_tis.megatron_rl.host.RolloutIndex` elements, in the loader's order.

``forwards`` counts the passes per role (``old``, ``ref``), ``skipped`` the skipped ones, ``rejected`` the rows
marked by :func:`check_inference_log_probs` (``missing``, ``length``) and ``appended`` the appended tokens it left
out of the loss; each collection's appended-token count goes to the host (:meth:`RLHost.begin_rollout`), which
logs it with the step's metrics (``tis/appended_tokens``).
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
    """The wrapped ``prepare_data_for_update`` / ``compute_logprobs_batch`` of one ``rl_utils`` module.

    Args:
        rl_utils: the module (``megatron.rl.rl_utils``; the tests' stand-in).
        host: returns the :class:`RLHost` (built from Megatron-LM's arguments on first use).
        read_item: a training loader element -> the item (a packed bin index -> the bin's parts).
    """

    def __init__(self, rl_utils: Any, host: Callable[[], RLHost], read_item: Callable[[Any], Any],
                 args: Callable[[], Any]) -> None:
        self.rl_utils, self.host, self.read_item, self.args = rl_utils, host, read_item, args
        self.forwards: Counter = Counter()
        self.skipped: Counter = Counter()
        self.rejected: Counter = Counter()  # rows marked by check_inference_log_probs: "missing", "length"
        self.appended = 0  # appended tokens check_inference_log_probs left out of the loss, all collections
        self._appended: int | None = None  # the current collection's (None: not checked, algorithm 0)
        self._calls: int | None = None  # compute_logprobs_batch calls inside prepare_data_for_update

    def install(self) -> None:
        rl = self.rl_utils
        if not callable(getattr(rl, "prepare_trajectories", None)):
            raise RuntimeError("slime_tis.megatron_rl: rl_utils has no prepare_trajectories; this Megatron-LM "
                               "version is not supported")
        rl.prepare_data_for_update = self._wrap_prepare(rl.prepare_data_for_update)
        rl.compute_logprobs_batch = self._wrap_compute(rl.compute_logprobs_batch)

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
        """``prepare_trajectories`` with each row's inference log-probs checked against its generated tokens
        (``check_inference_log_probs``); returns the checked generation masks and log-probs."""
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
        """Megatron-LM's ``logprobs_forward_step`` through the host: ``([B, S-1] float32 log-probs at the
        sampling temperature, None)`` on the last pipeline stage, the model output elsewhere."""
        host = self.host()
        model.eval()
        if packing_context is not None:
            index = int(next(data_iterator)[0].item())  # host-sync-ok: the loader's bin index, before the forward
            parts = self.rl_utils.load_packed_data_by_index(index, packing_context, is_correction)
            tokens, pos = parts[0], parts[4]
            b = PackedBin(tokens, pos, parts[3], parts[7], parts[8], parts[9], parts[10])
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
    """Per row of ``prepare_trajectories``' output, whether its last generated token ends its rollout's final
    turn, where its ``rows`` argument shows turns: Megatron-LM trains the turns of a multi-turn rollout whose turns
    are no prefix chain one row each, as ``(rollout, turn index)``; ``None`` where ``rows`` is not one entry per
    output row (every row is then taken as ending its rollout)."""
    if not isinstance(rows, (list, tuple)) or len(rows) != n:
        return None
    return [not (isinstance(r, tuple) and len(r) == 2 and hasattr(r[0], "trajectory"))
            or int(r[1]) == len(r[0].trajectory) - 1 for r in rows]


def check_inference_log_probs(generation_masks: Tensor, inference: list, cfg: Any,
                              final_turn: list[bool] | None = None) -> tuple[Tensor, list, Counter]:
    """Each row's inference log-probs against its generated tokens, before Megatron-LM pads and places them.

    ``generation_masks``: ``[N, S]`` bool; ``inference``: one 1-D tensor per row (the log-probs of the row's
    generated tokens, in order: the ``k``-th goes to the ``k``-th generated token) or ``None``; ``final_turn``: per
    row, whether its last generated token ends its rollout's final turn (:func:`final_turns`; ``None``: all do).
    Row ``i`` with ``g_i = sum(generation_masks[i]) > 0`` generated tokens and ``n_i`` log-probs (0 for ``None``):

    * ``n_i == g_i``: kept as it is;
    * ``n_i == g_i - 1 > 0`` in a row whose last generated token ends the final turn (``"appended"``): that token
      was appended on the training side (Megatron-LM's end-of-document token) and not sampled by the inference
      engine, so there is no rollout log-prob to correct it against; it is cleared from the row's generation mask,
      which Megatron-LM turns into the loss mask (unpacked rows and packed bins) and by which it places the
      log-probs, so that token leaves the loss and the row's other tokens train with their log-probs;
    * otherwise (``"missing"``: none; ``"length"``: any other count) its log-probs become ``g_i`` values of
      ``-inf``, which Megatron-LM places on every generated slot of the row (within ``|exp(lp_old) - exp(lp_inf)|
      <= 1``, the check its unpacked alignment asserts), so the core rejects the sequence as a whole as
      non-finite: excluded from the loss, the batch normalisation and the diagnostics, and counted in
      ``tis/nonfinite_seq_fraction``.

    Returns ``(generation masks [N, S] bool, the rows, count per reason)``; the masks are a new tensor where a
    token was cleared, the argument otherwise.

    A ``ValueError`` (one line) where rows have generated tokens and none of them carries a log-prob: the
    algorithm (``cfg.algorithm`` 1-3) reads the inference log-probs and the rollouts bring none.
    """
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
    """Wrap ``rl_utils``' ``prepare_data_for_update`` and ``compute_logprobs_batch`` (module docstring)."""
    hooks = RolloutHooks(rl_utils, host, read_item, args)
    hooks.install()
    return hooks
