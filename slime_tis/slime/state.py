"""The slime hooks' one process-wide state (:data:`STATE`), with one :meth:`SlimeState.clear`: what a later hook
needs from an earlier one (slime calls them by path and drops unknown ``rollout_data`` keys).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from slime_tis.engine.step import StepEngine
from slime_tis.engine.totals import StepTotals
from slime_tis.slime.compat import slime_function_params, slime_source
from slime_tis.slime.metrics import ExactMetricsCollector
from slime_tis.slime.record import TrainLogProbRecorder

__all__ = ["SlimeState", "STATE"]


@dataclass
class SlimeState:
    """Per rollout (reset by :meth:`new_rollout`): ``rollout_id``, its ``batch_norm_factor`` (or None) and the
    ``TISConfig`` it was computed for, ``drop_checked`` (:mod:`slime_tis.slime.kept`) and the ``advantages`` of
    each loss-mask tensor (``id(mask) -> (mask, advantages)``). Per process: the exact-metric ``collector``, the
    training log-prob ``recorder``, the ``views`` of slime's arguments (:func:`slime_tis.slime.config.slime_view`),
    the configurations ``described`` in the log and the ``warned`` keys."""

    rollout_id: object = None
    batch_norm_factor: Tensor | None = None
    batch_norm_key: object = None
    drop_checked: bool = False
    advantages: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    collector: ExactMetricsCollector = field(default_factory=ExactMetricsCollector)
    recorder: TrainLogProbRecorder = field(default_factory=TrainLogProbRecorder)
    views: dict[tuple, Any] = field(default_factory=dict)
    described: set = field(default_factory=set)
    warned: set[str] = field(default_factory=set)

    def new_rollout(self) -> None:
        """Forget the previous rollout's scalars and samples (the rollout-data hook, before each rollout)."""
        self.rollout_id = self.batch_norm_factor = self.batch_norm_key = None
        self.drop_checked = False
        self.advantages.clear()

    def clear(self) -> None:
        """Forget everything: the rollout, unflushed records, recordings, views, warnings and slime probes."""
        self.new_rollout()
        self.collector.reset()
        self.recorder.clear()
        self.views.clear()
        self.described.clear()
        self.warned.clear()
        slime_source.cache_clear()
        slime_function_params.cache_clear()

    def warn_once(self, key: str, msg: str, logger: Any) -> None:
        """Log and warn ``msg`` once per process (per ``key``)."""
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(msg)
            warnings.warn(msg, stacklevel=4)

    def engine(self, cfg: Any, reducer: Any, device: torch.device, *, batch_norm_factor: Tensor | None = None,
               host_kl: bool = False) -> StepEngine:
        """The step engine of one hook call: slime aggregates the loss itself, so the totals are denominator 1 and the
        rollout's batch-normalisation factor; its records go to :attr:`collector`."""
        one = torch.ones((), device=device)  # a device tensor: a Python float would sync the host
        return StepEngine(cfg, reducer, totals=StepTotals(one, one, batch_norm_factor, 1),
                          collector=self.collector.records, host_kl=host_kl)


STATE = SlimeState()
