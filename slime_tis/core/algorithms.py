"""The four algorithms (``use_rollout_log_probs + 2 * use_tis``; docs/semantics.md), one row each. A sequence counts in
the loss only if every input its loss reads (lp_theta, the advantages, lp_old where the row needs pi_old, lp_rollout
where it reads them) is finite at all its valid tokens: :func:`correction_inputs` lays them out for the one
correction call that decides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["Algorithm", "ALGORITHMS", "CorrectionInputs", "algorithm_of", "correction_inputs"]


@dataclass(frozen=True)
class Algorithm:
    """One row of :data:`ALGORITHMS`: ``anchor`` the PPO ratio's denominator (``None``: no ratio), ``lp_train`` the
    numerator of ``r = pi_train / pi_rollout`` (detached), ``reads_rollout`` the loss needs rollout log-probs,
    ``surrogate`` the default row of ``core.surrogates``, ``name`` the start-up line's name."""

    number: int
    anchor: str | None
    weighted: bool
    lp_train: str
    reads_rollout: bool
    surrogate: str
    name: str

    @property
    def needs_pi_old(self) -> bool:
        """Algorithms 0, 2: pi_old is the numerator of ``r`` and the PPO anchor."""
        return self.lp_train == "lp_old"

    @property
    def ppo(self) -> bool:
        """Algorithms 0-2 (a ratio anchor: the PPO family), not REINFORCE."""
        return self.anchor is not None

    @property
    def step_batch_norm(self) -> bool:
        """Algorithm 2: batch normalisation is fixed once per step (weights from pi_old); 3: per micro-batch."""
        return self.weighted and self.needs_pi_old

    @property
    def corrects(self) -> bool:
        """Algorithms 1-3: the correction's rules act and its keep mask is the loss's (0 only diagnoses)."""
        return self.reads_rollout


ALGORITHMS: dict[int, Algorithm] = {  # number, anchor, weighted, lp_train, reads_rollout, surrogate, name
    0: Algorithm(0, "lp_old", False, "lp_old", False, "ppo_clip", "standard PPO (old = Megatron recompute)"),
    1: Algorithm(1, "lp_rollout", False, "lp_theta", True, "ppo_clip", "bypass PPO (old = rollout log-probs)"),
    2: Algorithm(2, "lp_old", True, "lp_old", True, "ppo_clip", "decoupled PPO (w = pi_old / pi_rollout)"),
    3: Algorithm(3, None, True, "lp_theta", True, "reinforce", "REINFORCE + IS (w = sg(pi_theta) / pi_rollout)"),
}


def algorithm_of(config: Any) -> Algorithm:
    """The row of a ``TISConfig``, a ``Plan`` or an algorithm number."""
    number = config if isinstance(config, int) else config.algorithm
    if number not in ALGORITHMS:
        raise ValueError(f"algorithm = {number!r}: must be one of 0, 1, 2, 3")
    return ALGORITHMS[number]


class CorrectionInputs(NamedTuple):
    """The inputs of one correction call (``core.correction.correct`` / ``compute_tis``)."""

    lp_train: Tensor
    lp_rollout: Tensor
    extra_finite: tuple[Tensor, ...]
    loss_finite: tuple[Tensor, ...]


def correction_inputs(config: Any, *, lp_train: Tensor, lp_rollout: Tensor | None, advantages: Tensor | None,
                      lp_theta: Tensor | None = None, terms: tuple[Tensor, ...] = ()) -> CorrectionInputs:
    """The detached inputs of the correction call that decides which sequences count (``[T]`` each).

    ``lp_rollout=None`` (algorithm 0 without them): ``lp_train`` stands in, every log-ratio is 0. ``advantages``,
    ``lp_theta`` (rows whose ``lp_train`` is pi_old) and ``terms`` (``core.terms`` inputs), where given, are the
    loss's other inputs: ``extra_finite`` in algorithms 1-3 (they reject the sequence, diagnostics included),
    ``loss_finite`` with ``lp_train`` in algorithm 0 (they decide only the loss's keep mask).
    """
    row = algorithm_of(config)
    rollout = lp_train if lp_rollout is None else lp_rollout
    others = tuple(t.detach() for t in (advantages, lp_theta if row.needs_pi_old else None, *terms)
                   if t is not None)
    if row.corrects:
        return CorrectionInputs(lp_train.detach(), rollout.detach(), others, ())
    return CorrectionInputs(lp_train.detach(), rollout.detach(), (), (lp_train.detach(),) + others)
