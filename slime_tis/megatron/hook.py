"""``tis_forward_backward_func``: megatron's ``forward_backward_func`` with the rollout correction in every training
call, in the order of docs/megatron.md, "What the wrapped forward_backward does per optimizer step"
(``forward_only=True`` calls go straight to megatron); ``tis_patch``: ``get_forward_backward_func()`` returning it
inside a block (docs/megatron.md, "Megatron-LM's training loop").
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
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
from slime_tis.megatron.arguments import megatron_hook_kwargs
from slime_tis.megatron.loss import forward_step_with_tis_loss, loss_form_for
from slime_tis.megatron.output_layer import model_output_mode
from slime_tis.megatron.rank_failure import Phase, reporting
from slime_tis.megatron.recompute import compute_old_log_probs, forward_only_log_probs
from slime_tis.megatron.routing_replay import RoutingReplay, default_get_routing
from slime_tis.megatron.schedule import default_get_tis_batch, materialise, replay, step_batches

__all__ = ["TISForwardBackward", "tis_forward_backward_func", "tis_patch", "default_get_tis_batch", "PI_OLD_MODES"]

#: Training calls begun in this process over every hook, compared across ranks with the step metrics.
_TRAINING_CALLS = itertools.count(1)

#: ``"auto"``: a missing pi_old is the step's own until ``compute_old_log_probs`` ran; ``"rollout"``: never recompute.
PI_OLD_MODES = ("auto", "rollout")


def hook_settings(hook: Any) -> dict[str, Any]:
    """The settings of a ``TISForwardBackward`` that decide its collectives and its numbers."""
    own = {
        "temperature": hook.logprobs.temperature, "chunk_size": hook.logprobs.chunk_size, "pi_old": hook.pi_old,
        "broadcast_over_tp": hook.broadcast_over_tp, "grad_average": hook.grad_average,
        "metrics_in_loss_dicts": hook.metrics_in_loss_dicts, "output_layer": hook.logprobs.output_layer,
        "reducer": None if hook.reducer is None else type(hook.reducer).__qualname__,
        "routing_replay": hook.routing is not None and hook.routing.replay,
        "routing_metrics": hook.routing is not None and hook.routing.count,
    }
    return {**config_settings(hook.cfg), **{f"tis_forward_backward_func({k}=)": v for k, v in own.items()}}


class TISForwardBackward:
    """Callable with megatron's ``forward_backward_func`` keyword signature; its keywords are listed in
    docs/megatron.md, "Public API".

    Attributes: ``last_metrics`` (the last training call's finalized metrics, float64 0-d tensors identical on the
    last stage's DP x CP ranks, ``{}`` elsewhere), ``last_totals`` (its ``StepTotals`` or ``None``),
    ``last_recomputed`` (it ran a forward-only pass), ``logprobs`` (the ``LogProbSettings`` of every pass),
    ``routing`` (the ``RoutingReplay`` or ``None``).
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
        self.logprobs = LogProbSettings(temperature, chunk_size, output_layer_of(fused_output_layer, fp32_lm_head),
                                        cfg.kernels, cfg.sampling_support)
        cfg.warn_inert()
        self.forward_backward_func, self.cfg, self.get_tis_batch = forward_backward_func, cfg, get_tis_batch
        self.reducer, self.pi_old, self.grad_average = reducer, pi_old, grad_average
        self.broadcast_over_tp, self.metrics_in_loss_dicts = bool(broadcast_over_tp), bool(metrics_in_loss_dicts)
        count = routing_replay if routing_metrics is None else routing_metrics
        self.routing = None if not (routing_replay or count) else RoutingReplay(
            replay=routing_replay, count=count, get_routing=get_routing or default_get_routing)
        self.last_metrics: dict[str, Tensor] = {}
        self.last_totals: StepTotals | None = None
        self.last_recomputed = self._settings_agreed = self._warned_supplied = False
        self.train_call = 0  # process-wide number of this hook's last training call

    def _check_settings_agree(self) -> None:
        """Once, before this hook's first collective: the same configuration and settings on every rank."""
        if not self._settings_agreed:
            check_settings_agree(hook_settings(self), what="tis_forward_backward_func")
            self._settings_agreed = True

    def compute_old_log_probs(self, *, forward_step_func: Callable, data_iterator: Any, model: Any,
                              num_microbatches: int, num_steps: int = 1, **schedule_kwargs: Any) -> Any:
        """``recompute.compute_old_log_probs`` with this hook's settings; afterwards the hook never recomputes
        pi_old (every rank calls this, so every rank switches together). Returns the rollout's items."""
        with reporting(Phase("the rollout's pi_old pass (compute_old_log_probs)")) as phase:
            phase.name = "the settings check"
            self._check_settings_agree()
            phase.name = "the forward-only schedule"
            lp = self.logprobs
            with self._routed(forward_step_func, training=False) as step_func:
                items = compute_old_log_probs(
                    self.forward_backward_func, step_func, data_iterator, model, num_microbatches=num_microbatches,
                    num_steps=num_steps, temperature=lp.temperature, chunk_size=lp.chunk_size,
                    fused_output_layer=lp.output_layer == "fused", fp32_lm_head=lp.output_layer == "fp32",
                    kernels=lp.kernels, sampling_support=lp.sampling_support, get_tis_batch=self.get_tis_batch,
                    broadcast_over_tp=self.broadcast_over_tp, run_pass=algorithm_of(self.cfg).needs_pi_old,
                    **schedule_kwargs)
        self.pi_old = "rollout"
        return items

    def _routed(self, forward_step_func: Callable, *, training: bool) -> Any:
        """The launcher's ``forward_step`` for one pass, with the engine's routing where routing is configured."""
        if self.routing is None:
            return contextlib.nullcontext(forward_step_func)
        return self.routing.active(forward_step_func, training=training)

    def __call__(self, *, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int,
                 forward_only: bool = False, **kwargs: Any) -> list:
        if forward_only:
            return self.forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, forward_only=True, **kwargs)
        with reporting(Phase("a training call")) as phase:
            return self._train(phase, forward_step_func, data_iterator, model, num_microbatches, kwargs)

    def _train(self, phase: Phase, forward_step_func: Callable, data_iterator: Any, model: Any,
               num_microbatches: int, kwargs: dict[str, Any]) -> list:
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
        recomputes = algorithm_of(cfg).needs_pi_old and self.pi_old == "auto"  # pi_old at the step's parameters
        pi_old_pass = recomputes and needs_pi_old_pass(cfg)
        pi_old_from_theta = recomputes and not pi_old_pass  # no extra forward: sg(lp_theta)
        self.last_recomputed = pi_old_pass or needs_pre_pass(cfg)
        with model_output_mode(model, self.logprobs.output_layer):
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
        """Copies of the step's batches with the recomputed pi_old where none was supplied (warned once)."""
        supplied = sum(b.old_log_probs is not None for b in batches)
        if supplied and not self._warned_supplied:
            self._warned_supplied = True
            warnings.warn(f"{supplied} of {len(batches)} micro-batches carry old_log_probs: used as given; the "
                          "per-call recompute pass ran anyway (pi_old='auto'). Pass pi_old='rollout' to "
                          "tis_forward_backward_func (or use its compute_old_log_probs) to skip it.",
                          stacklevel=3)
        return [b if b.old_log_probs is not None else dataclasses.replace(b, old_log_probs=lp)
                for b, lp in zip(batches, lps)]


#: ``tis_forward_backward_func(forward_backward_func, cfg, **options)``: megatron's schedule with the correction.
tis_forward_backward_func = TISForwardBackward


_ATTR = "get_forward_backward_func"


@contextlib.contextmanager
def tis_patch(cfg: TISConfig | None = None, *, temperature: float | None = None,
              fused_output_layer: bool | None = None, fp32_lm_head: bool | None = None,
              routing_replay: bool | None = None, chunk_size: int = CHUNK_SIZE, modules: Sequence[Any] = (),
              **hook_kwargs: Any) -> Iterator[None]:
    """Inside the block ``get_forward_backward_func()`` returns the hooked schedule in megatron-core's
    ``pipeline_parallel`` (and ``.schedules``) and every module of ``modules`` (``from ... import`` binds a copy).
    ``cfg=None``: the configuration and the ``None`` keywords from Megatron-LM's parsed arguments when the schedule
    is first requested; with a ``cfg`` a ``None`` keyword is its default."""
    import megatron.core.pipeline_parallel as pp_pkg
    from megatron.core.pipeline_parallel import schedules

    if cfg is not None and not isinstance(cfg, TISConfig):
        raise ValueError(f"tis_patch: cfg must be a slime_tis.TISConfig or None, got {type(cfg).__name__}")
    original = schedules.get_forward_backward_func

    def hooked_get_forward_backward_func(*args: Any, **kwargs: Any):
        parsed = None  # without Megatron-LM's arguments megatron_hook_kwargs gives the keywords' defaults
        if cfg is None:
            try:
                from megatron.training import get_args
            except ImportError as err:
                raise ValueError("tis_patch(cfg=None) reads Megatron-LM's arguments (megatron.training.get_args), "
                                 "which is not importable here; pass cfg=TISConfig(...) and temperature=...") from err
            parsed = get_args()
        defaults = megatron_hook_kwargs(parsed)
        given = {"temperature": temperature, "fused_output_layer": fused_output_layer, "fp32_lm_head": fp32_lm_head,
                 "routing_replay": routing_replay}
        resolved = {k: defaults[k] if v is None else v for k, v in given.items()}
        return tis_forward_backward_func(original(*args, **kwargs), TISConfig.from_args(parsed) if cfg is None else cfg,
                                         chunk_size=chunk_size, **resolved, **hook_kwargs)

    targets = [schedules, pp_pkg, *modules]
    for mod in targets:  # validate everything before changing anything
        if not hasattr(mod, _ATTR):
            raise ValueError(f"tis_patch: module {getattr(mod, '__name__', mod)!r} has no {_ATTR} to patch")
    saved = [(mod, getattr(mod, _ATTR)) for mod in targets]
    for mod in targets:
        setattr(mod, _ATTR, hooked_get_forward_backward_func)
    try:
        yield
    finally:
        for mod, value in reversed(saved):
            setattr(mod, _ATTR, value)
