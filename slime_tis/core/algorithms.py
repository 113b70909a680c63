"""The four algorithms, one row each: what every adapter asks of an algorithm is read here.

``algorithm = use_rollout_log_probs + 2 * use_tis``. Per kept token (``A`` advantage, ``w`` the detached
importance weight of ``r = pi_train / pi_rollout``, ``f`` the surrogate of ``core.surrogates``; its default is the
row's, ``--tis-loss-mode`` picks another)::

    alg  pi_old  anchor       weighted  lp_train (r's numerator)  surrogate  per-token loss
    0    yes     lp_old       no        lp_old                    ppo_clip   f(lp_theta, anchor)
    1    no      lp_rollout   no        sg(lp_theta)              ppo_clip   f(lp_theta, anchor)
    2    yes     lp_old       yes       lp_old                    ppo_clip   w * f(lp_theta, anchor)
    3    no      (none)       yes       sg(lp_theta)              reinforce  w * f(lp_theta)      (f = -A lp_theta)

A surrogate with a ratio (``ppo_clip``, ``gspo``, ``cispo``) needs the row's anchor: algorithm 3 has none (its weight
``w = sg(pi_theta) / pi_rollout`` is already the ratio against the rollout policy; a rollout-anchored ratio on top
would count it twice), so it takes the surrogates without a ratio (``reinforce``, ``on_policy``), which every
algorithm takes.

The non-finite policy, the same for every algorithm and adapter: **a sequence counts in the loss only if every
input its loss reads is finite at all its valid tokens** (the row's :attr:`Algorithm.finite`: lp_theta, the
advantages, lp_old where the row needs pi_old, lp_rollout where the loss reads it). Such a sequence is rejected
and counted (``nonfinite_seq_fraction``). In algorithms 1-3 the correction decides the loss, so its diagnostics
see the same sequences; algorithm 0's correction only diagnoses (its ``tis/*`` metrics cover the sequences with
finite lp_old and lp_rollout) and its loss's inputs are one more per-sequence column of the same call.
:func:`correction_inputs` lays the inputs out for the one correction call (``core.correction.correct``) that
decides it, so the loss, the Megatron step totals and the slime hooks decide alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["Algorithm", "ALGORITHMS", "CorrectionInputs", "algorithm_of", "correction_inputs"]


@dataclass(frozen=True)
class Algorithm:
    """One row of :data:`ALGORITHMS`.

    Attributes:
        number: 0..3.
        anchor: the PPO ratio's denominator, ``"lp_old"`` or ``"lp_rollout"``; ``None``: no PPO ratio (REINFORCE).
        weighted: importance weights multiply the loss.
        lp_train: the training-side log-prob of ``r = pi_train / pi_rollout``: ``"lp_old"`` or ``"lp_theta"``
            (detached).
        reads_rollout: the loss needs rollout log-probs (algorithm 0 takes them for diagnostics only).
        surrogate: the default surrogate (a row of ``core.surrogates.SURROGATES``).
        loss: the per-token loss, in words (``core.losses`` computes it).
    """

    number: int
    anchor: str | None
    weighted: bool
    lp_train: str
    reads_rollout: bool
    surrogate: str
    loss: str

    @property
    def needs_pi_old(self) -> bool:
        """The row reads pi_old (algorithms 0, 2): it is the numerator of ``r`` (``lp_train``) and the PPO anchor."""
        return self.lp_train == "lp_old"

    @property
    def finite(self) -> tuple[str, ...]:
        """Inputs that must be finite at every valid token of a sequence for it to count in the loss."""
        return (("lp_theta",) + (("lp_old",) if self.needs_pi_old else ())
                + (("lp_rollout",) if self.reads_rollout else ()) + ("advantages",))

    @property
    def ppo(self) -> bool:
        """The row has a ratio anchor (algorithms 0-2: the PPO family, slime's own policy loss), not REINFORCE."""
        return self.anchor is not None

    @property
    def step_batch_norm(self) -> bool:
        """Batch normalisation covers the whole step, fixed before it (the weights read pi_old, known before the
        step: algorithm 2); otherwise (algorithm 3) each micro-batch normalises over its own data."""
        return self.weighted and self.needs_pi_old

    @property
    def corrects(self) -> bool:
        """The correction decides the loss: its rules act and its keep mask is the loss's (algorithms 1-3);
        algorithm 0's only diagnoses (it rejects only non-finite data)."""
        return self.reads_rollout


ALGORITHMS: dict[int, Algorithm] = {
    0: Algorithm(0, anchor="lp_old", weighted=False, lp_train="lp_old", reads_rollout=False,
                 surrogate="ppo_clip", loss="f(lp_theta, lp_old)"),
    1: Algorithm(1, anchor="lp_rollout", weighted=False, lp_train="lp_theta",
                 reads_rollout=True, surrogate="ppo_clip", loss="f(lp_theta, lp_rollout)"),
    2: Algorithm(2, anchor="lp_old", weighted=True, lp_train="lp_old", reads_rollout=True,
                 surrogate="ppo_clip", loss="w * f(lp_theta, lp_old)"),
    3: Algorithm(3, anchor=None, weighted=True, lp_train="lp_theta", reads_rollout=True,
                 surrogate="reinforce", loss="w * f(lp_theta)"),
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
    """The inputs of the correction call that decides which sequences count (module docstring).

    Args:
        lp_train: ``[T]`` the row's training-side log-probs (:attr:`Algorithm.lp_train`).
        lp_rollout: ``[T]`` rollout log-probs, or ``None`` (algorithm 0 without them: ``lp_train`` stands in,
            every log-ratio is 0 and no rollout data is checked).
        advantages: ``[T]`` advantages, or a per-token value computed from them and lp_theta (slime's PPO
            ``pg_loss``); ``None`` where the caller has neither.
        lp_theta: ``[T]`` the current log-probs where they are not ``lp_train`` already (rows whose
            ``lp_train`` is ``lp_old``); ``None`` where not known (before the step, without a forward pass at
            its parameters).
        terms: ``[T]`` inputs of the loss's added terms (reference log-probs, entropy; ``core.terms``): checked
            like the advantages.

    Returns:
        Detached tensors. Rows that correct (1-3): ``extra_finite`` holds the loss's other inputs (their
        non-finite valid entries reject the sequence, diagnostics included); ``loss_finite`` is empty.
        Algorithm 0: ``extra_finite`` is empty (the diagnostics compare lp_old with lp_rollout only) and
        ``loss_finite`` holds the loss's inputs (they decide its keep mask, whatever the rollout data).
    """
    row = algorithm_of(config)
    rollout = lp_train if lp_rollout is None else lp_rollout
    others = tuple(t.detach() for t in (advantages, lp_theta if row.needs_pi_old else None, *terms)
                   if t is not None)
    if row.corrects:
        return CorrectionInputs(lp_train.detach(), rollout.detach(), others, ())
    return CorrectionInputs(lp_train.detach(), rollout.detach(), (), (lp_train.detach(),) + others)
