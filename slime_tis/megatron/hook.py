"""``tis_forward_backward_func``: wrap megatron's ``forward_backward_func`` so every step uses the correction.

One training call (``forward_only=False``), in order (docs/megatron.md, "What the wrapped forward_backward does"):

0. first call only: the configuration and the hook's settings agree across the job's ranks (``agreement``: a
   ``ValueError`` naming the differing setting on every rank, before any collective that depends on it);
1. the step's ``num_microbatches`` items read once from ``data_iterator`` and replayed (``schedule``);
2. last pipeline stage: the step's ``TISBatch`` list, broadcast from TP rank 0 under TP > 1 (``tp_data``);
3. pi_old (algorithms 0, 2) as given in ``TISBatch.old_log_probs`` (once per rollout:
   :meth:`TISForwardBackward.compute_old_log_probs`), never overwritten; with ``pi_old="auto"`` and no rollout
   pass, the detached ``lp_theta`` of each micro-batch's own forward, plus one forward-only pass where the step
   totals need it first (``engine.totals.needs_pi_old_pass``; algorithms 1, 3 with ``drop``: ``needs_pre_pass``),
   decided by the configuration and the mode, never by the data;
4. last pipeline stage: ``StepEngine.begin``, the step's global scalars on megatron's DP / CP groups;
5. megatron's schedule with the launcher's ``forward_step_func`` whose loss function is ours
   (``loss.forward_step_with_tis_loss``), every keyword forwarded;
6. the step metrics (``StepEngine.end``) into ``last_metrics`` and every micro-batch loss dict as ``[value, 1]``
   (``engine.megatron_schedule``); ranks whose training calls are out of step raise ``RuntimeError`` together.

An error leaving a call is recorded with its rank and phase (``rank_failure``) and named on the other ranks as a
``RankFailedError``. With ``fused_output_layer`` / ``fp32_lm_head`` steps 3-5 run with the model's output layer
switched (``output_layer.model_output_mode``; docs/output_layer.md) and switched back after; ``Float16Module``
returns the logits in the model's dtype there (``model_dtype_output``). With ``routing_replay``
(``--tis-routing-replay``) every pass runs the launcher's ``forward_step`` under ``routing_replay.RoutingReplay``:
each micro-batch's MoE routers use the rollout engine's experts (docs/megatron.md). ``forward_only=True`` calls go
straight to megatron.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from collections.abc import Callable
from typing import Any

from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import Reducer
from slime_tis.core.algorithms import algorithm_of
from slime_tis.engine.agreement import check_settings_agree, config_settings
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.megatron_schedule import add_metrics_to_loss_dicts
from slime_tis.engine.settings import CHUNK_SIZE, LogProbSettings, output_layer_of
from slime_tis.engine.step import StepEngine
from slime_tis.engine.totals import StepTotals, needs_pi_old_pass, needs_pre_pass
from slime_tis.megatron.loss import forward_step_with_tis_loss, loss_form_for
from slime_tis.megatron.output_layer import model_output_mode
from slime_tis.megatron.rank_failure import Phase, reporting
from slime_tis.megatron.recompute import forward_only_log_probs
from slime_tis.megatron.rollout import rollout_old_log_probs
from slime_tis.megatron.routing_replay import RoutingReplay, default_get_routing
from slime_tis.megatron.schedule import materialise, replay
from slime_tis.megatron.tp_data import default_get_tis_batch, step_batches

__all__ = ["TISForwardBackward", "tis_forward_backward_func", "default_get_tis_batch", "PI_OLD_MODES"]

#: Training calls begun in this process, over every hook (a launcher may build a new hook per step, as
#: ``tis_patch`` does): each call's number is compared across ranks with its step metrics.
_TRAINING_CALLS = itertools.count(1)

#: ``"auto"``: a missing pi_old is the step's own (detached training log-probs, or a forward-only pass where the
#: plan needs it up front) until ``compute_old_log_probs`` has run through the hook, then as ``"rollout"``.
#: ``"rollout"``: never recompute; every micro-batch must carry ``old_log_probs``.
PI_OLD_MODES = ("auto", "rollout")


def hook_settings(hook: Any) -> dict[str, Any]:
    """The settings of a ``TISForwardBackward`` that decide its collectives and its numbers."""
    own = {
        "temperature": hook.temperature, "chunk_size": hook.chunk_size, "pi_old": hook.pi_old,
        "broadcast_over_tp": hook.broadcast_over_tp, "grad_average": hook.grad_average,
        "metrics_in_loss_dicts": hook.metrics_in_loss_dicts, "output_layer": hook.output_layer,
        "reducer": None if hook.reducer is None else type(hook.reducer).__qualname__,
        "routing_replay": hook.routing is not None and hook.routing.replay,
        "routing_metrics": hook.routing is not None and hook.routing.count,
    }
    return {**config_settings(hook.cfg), **{f"tis_forward_backward_func({k}=)": v for k, v in own.items()}}


class TISForwardBackward:
    """Callable with megatron's ``forward_backward_func`` keyword signature (see module docstring).

    Attributes:
        last_metrics: finalized metrics of the last training call (dict of float64 scalar tensors on the
            last pipeline stage, identical on its DP x CP ranks; ``{}`` elsewhere).
        last_totals: the :class:`~slime_tis.engine.totals.StepTotals` of the last training call (last
            stage) or ``None``.
        last_recomputed: whether the last training call ran a pi_old recompute pass.
        logprobs: the :class:`~slime_tis.engine.settings.LogProbSettings` of every pass (``temperature``,
            ``chunk_size``, ``output_layer``: ``None``, ``"fused"`` or ``"fp32"`` from ``fused_output_layer`` /
            ``fp32_lm_head``, and ``cfg.kernels``; also read as attributes of the same names).

    Keywords (written once, here; :func:`tis_forward_backward_func` passes them on):
        temperature: the rollout sampling temperature (logits are divided by it).
        chunk_size: rows per log-softmax chunk.
        get_tis_batch: the ``TISBatch`` of a micro-batch item (default ``item["tis"]``).
        reducer: the core's reducer (default: ``MegatronReducer`` on the schedule's groups, per call).
        pi_old: ``"auto"`` (default) recomputes pi_old at the start of each training call for micro-batches
            that carry none, until :meth:`TISForwardBackward.compute_old_log_probs` has run (correct for one
            optimizer step per rollout); ``"rollout"`` never recomputes (the caller supplies pi_old).
        broadcast_over_tp: broadcast TP rank 0's ``TISBatch`` items to the other TP ranks (``tp_data``).
        grad_average: the factor the data-parallel wrapper divides summed gradients by, for wrappers the hook
            cannot read (``engine.megatron_schedule``); default: read from megatron / torch DDP.
        metrics_in_loss_dicts: add ``[value, 1]`` of every step metric to the loss dicts (``engine.megatron_schedule``).
        fused_output_layer: ``--tis-fused-output-layer``: log-probs straight from the hidden states and the
            output weight (``output_layer.fused_log_probs``), in the loss and in every pi_old pass.
        fp32_lm_head: ``--tis-fp32-lm-head``: the output matmul in float32 (float32 logits), in the loss and in
            every pi_old pass. Mutually exclusive with ``fused_output_layer``.
        routing_replay: ``--tis-routing-replay``: every forward of the hook's passes (pi_old and training) routes
            each MoE layer's tokens to the rollout engine's experts (``routing_replay``: megatron-core's
            ``RouterReplay``); the items must carry them (``get_routing``).
        routing_metrics: count ``moe/routing_mismatch``, ``moe/router_disagreement`` in the training forwards
            (default: ``routing_replay``); the items must carry the engine's routing.
        get_routing: the ``routing_replay.RoutingBatch`` of a micro-batch item (default ``item["routing"]``).
    """

    def __init__(self, forward_backward_func: Callable, cfg: TISConfig, *, temperature: float = 1.0,
                 chunk_size: int = CHUNK_SIZE, get_tis_batch: Callable[[Any], TISBatch] = default_get_tis_batch,
                 reducer: Reducer | None = None, pi_old: str = "auto", broadcast_over_tp: bool = True,
                 grad_average: float | None = None, metrics_in_loss_dicts: bool = True,
                 fused_output_layer: bool = False, fp32_lm_head: bool = False, routing_replay: bool = False,
                 routing_metrics: bool | None = None, get_routing: Callable[[Any], Any] | None = None) -> None:
        if not isinstance(cfg, TISConfig):
            raise ValueError(f"cfg must be a slime_tis.TISConfig, got {type(cfg).__name__}")
        if pi_old not in PI_OLD_MODES:
            raise ValueError(f"pi_old must be one of {PI_OLD_MODES}, got {pi_old!r}")
        if grad_average is not None:
            from slime_tis.engine.megatron_schedule import data_parallel_grad_average

            data_parallel_grad_average([], dp_cp_size=1, per_token=False, override=grad_average)  # validates
        #: how every log-prob of the hook's passes is taken (engine.settings), built once here
        self.logprobs = LogProbSettings(temperature, chunk_size, output_layer_of(fused_output_layer, fp32_lm_head),
                                        cfg.kernels, cfg.sampling_support)
        self.forward_backward_func = forward_backward_func
        self.cfg = cfg
        cfg.warn_inert()
        self.get_tis_batch = get_tis_batch
        self.reducer = reducer
        self.pi_old = pi_old
        self.broadcast_over_tp = bool(broadcast_over_tp)
        self.grad_average = grad_average
        self.metrics_in_loss_dicts = bool(metrics_in_loss_dicts)
        count = routing_replay if routing_metrics is None else routing_metrics
        #: MoE routing replay / metrics (``routing_replay.RoutingReplay``), or ``None``: the routers route alone
        self.routing = None if not (routing_replay or count) else RoutingReplay(
            replay=routing_replay, count=count, get_routing=get_routing or default_get_routing)
        self.last_metrics: dict[str, Tensor] = {}
        self.last_totals: StepTotals | None = None
        self.last_recomputed = False
        self.train_call = 0  # process-wide number of this hook's last training call (``_TRAINING_CALLS``)
        self._settings_agreed = False
        self._warned_supplied = False

    def _check_settings_agree(self) -> None:
        """Once, before this hook's first collective: every rank of the job runs the same configuration and
        hook settings (``agreement``; a ``ValueError`` naming the differing ones on every rank otherwise)."""
        if not self._settings_agreed:
            check_settings_agree(hook_settings(self), what="tis_forward_backward_func")
            self._settings_agreed = True

    @property
    def temperature(self) -> float:
        return self.logprobs.temperature

    @property
    def chunk_size(self) -> int:
        return self.logprobs.chunk_size

    @property
    def output_layer(self) -> str | None:
        return self.logprobs.output_layer

    @property
    def recomputes_pi_old(self) -> bool:
        """Whether a training call takes pi_old at its own parameters (``pi_old="auto"``, algorithms 0 and 2: one
        optimizer step per rollout). It costs a forward-only pass only where
        :func:`~slime_tis.engine.totals.needs_pi_old_pass` (``drop``, algorithm 2's batch normalisation);
        otherwise each micro-batch's loss uses the detached log-probs of its own training forward. Configuration
        and mode only, never data."""
        return algorithm_of(self.cfg).needs_pi_old and self.pi_old == "auto"

    def compute_old_log_probs(self, *, forward_step_func: Callable, data_iterator: Any, model: Any,
                              num_microbatches: int, num_steps: int = 1, **schedule_kwargs: Any) -> Any:
        """pi_old of a whole rollout (``rollout.compute_old_log_probs`` with this hook's temperature, chunk
        size, item accessor and TP broadcast); afterwards this hook never recomputes pi_old (every rank
        calls this, so every rank switches together). Returns the rollout's materialised items."""
        with reporting(Phase("the rollout's pi_old pass (compute_old_log_probs)")) as phase:
            phase.name = "the settings check"
            self._check_settings_agree()
            phase.name = "the forward-only schedule"
            items = self._compute_old_log_probs(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                                model=model, num_microbatches=num_microbatches, num_steps=num_steps,
                                                **schedule_kwargs)
        self.pi_old = "rollout"
        return items

    def _compute_old_log_probs(self, *, forward_step_func: Callable, data_iterator: Any, model: Any,
                               num_microbatches: int, num_steps: int, **schedule_kwargs: Any) -> Any:
        with self._routed(forward_step_func, training=False) as forward_step_func:
            return self._rollout_pass(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                      num_microbatches=num_microbatches, num_steps=num_steps, **schedule_kwargs)

    def _routed(self, forward_step_func: Callable, *, training: bool) -> Any:
        """The launcher's ``forward_step`` for one pass: with the engine's routing set per micro-batch
        (``routing_replay.RoutingReplay.active``; ``training``: the pass counts the routing metrics) when routing
        is configured, else as given."""
        if self.routing is None:
            return contextlib.nullcontext(forward_step_func)
        return self.routing.active(forward_step_func, training=training)

    def _rollout_pass(self, *, forward_step_func: Callable, data_iterator: Any, model: Any,
                      num_microbatches: int, num_steps: int, **schedule_kwargs: Any) -> Any:
        return rollout_old_log_probs(
            self.forward_backward_func, forward_step_func, data_iterator, model,
            num_microbatches=num_microbatches, num_steps=num_steps, settings=self.logprobs,
            get_tis_batch=self.get_tis_batch, broadcast_over_tp=self.broadcast_over_tp,
            run_pass=algorithm_of(self.cfg).needs_pi_old, **schedule_kwargs)

    def __call__(self, *, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int,
                 forward_only: bool = False, **kwargs: Any) -> list:
        if forward_only:
            return self.forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, forward_only=True, **kwargs)
        with reporting(Phase("a training call")) as phase:
            return self._train(phase, forward_step_func=forward_step_func, data_iterator=data_iterator,
                               model=model, num_microbatches=num_microbatches, **kwargs)

    def _train(self, phase: Phase, *, forward_step_func: Callable, data_iterator: Any, model: Any,
               num_microbatches: int, **kwargs: Any) -> list:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config

        from slime_tis.engine.reduce import reducer_for_schedule

        phase.name = "the settings check"
        self._check_settings_agree()
        self.train_call = next(_TRAINING_CALLS)
        phase.call = f"training call {self.train_call}"
        phase.name = "reading the micro-batches"
        cfg = self.cfg
        chunks = model if isinstance(model, list) else [model]
        vpp = len(chunks) > 1
        items = materialise(data_iterator, num_microbatches, vpp)
        is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
        form = loss_form_for(get_model_config(chunks[0]), chunks, num_microbatches, grad_average=self.grad_average)
        batches: list[TISBatch] | None = None
        if is_last:
            _, batches = step_batches(items, vpp=vpp, get_tis_batch=self.get_tis_batch,
                                      broadcast=self.broadcast_over_tp)
        reducer = self.reducer or reducer_for_schedule(kwargs)
        pre: list[Tensor] | None = None
        pi_old_pass = self.recomputes_pi_old and needs_pi_old_pass(cfg)
        pi_old_from_theta = self.recomputes_pi_old and not pi_old_pass  # no extra forward: sg(lp_theta)
        self.last_recomputed = pi_old_pass or needs_pre_pass(cfg)
        with model_output_mode(model, self.logprobs.output_layer):  # steps 3-5
            if self.last_recomputed:
                phase.name = "the pi_old pass"
                with self._routed(forward_step_func, training=False) as step_func:
                    lps = forward_only_log_probs(
                        self.forward_backward_func, step_func, items, model, batches=batches,
                        num_microbatches=num_microbatches, vpp=vpp, settings=self.logprobs, **kwargs)
                if batches is not None and lps is not None:
                    pre = lps  # lp_theta at the step's parameters: its non-finite values reject as in the loss
                    if pi_old_pass:
                        batches = self._fill_missing_pi_old(batches, lps)
            phase.name = "the step totals"
            engine = StepEngine(cfg, reducer) if batches is not None else None
            if engine is not None:
                engine.begin(batches, pre_log_probs=pre, pi_old_from_theta=pi_old_from_theta)
            phase.name = "megatron's forward-backward schedule (the loss function included)"
            with self._routed(forward_step_func, training=True) as step_func:
                forward_step = forward_step_with_tis_loss(step_func, engine, batches, form, settings=self.logprobs,
                                                          pi_old_from_theta=pi_old_from_theta)
                out = self.forward_backward_func(forward_step_func=forward_step, data_iterator=replay(items, vpp),
                                                 model=model, num_microbatches=num_microbatches, forward_only=False,
                                                 **kwargs)
        self.last_totals = None if engine is None else engine.totals
        phase.name = "the step metrics"
        self.last_metrics = engine.end(step=self.train_call) if is_last else {}
        if self.routing is not None:  # every rank: one all-reduce of the routing counts
            routing = self.routing.step_metrics()
            if is_last:
                self.last_metrics = {**self.last_metrics, **routing}
        if is_last and self.metrics_in_loss_dicts:
            add_metrics_to_loss_dicts(out, self.last_metrics)
        return out

    def _fill_missing_pi_old(self, batches: list[TISBatch], lps: list[Tensor]) -> list[TISBatch]:
        """Per-call mode: copies of the step's batches with the recomputed pi_old where none was supplied
        (the caller's objects are not modified; supplied values are used as given)."""
        supplied = sum(b.old_log_probs is not None for b in batches)
        if supplied and not self._warned_supplied:
            self._warned_supplied = True
            warnings.warn(f"{supplied} of {len(batches)} micro-batches carry old_log_probs: used as given; the "
                          "per-call recompute pass ran anyway (pi_old='auto'). Pass pi_old='rollout' to "
                          "tis_forward_backward_func (or use its compute_old_log_probs) to skip it.",
                          stacklevel=3)
        return [b if b.old_log_probs is not None else dataclasses.replace(b, old_log_probs=lp)
                for b, lp in zip(batches, lps)]


def tis_forward_backward_func(forward_backward_func: Callable, cfg: TISConfig, **options: Any) -> TISForwardBackward:
    """Wrap megatron's ``get_forward_backward_func()`` result with the rollout correction (see module doc):
    ``TISForwardBackward(forward_backward_func, cfg, **options)``, its keywords listed there."""
    return TISForwardBackward(forward_backward_func, cfg, **options)
