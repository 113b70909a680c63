"""A decision of one packed batch, restricted to some of its sequences: the decision of the smaller batch.

A host that decides a whole rollout at once (``StepEngine.decide``: one correction, once per rollout) and trains
it in micro-batches of its sequences hands each micro-batch its part: per-token quantities at the micro-batch's
tokens, per-sequence ones at its sequences, in the micro-batch's order. Every ``Ratios`` quantity is per token or
per (full) sequence, so the part is exactly what deciding the micro-batch alone gives; ``core.correction.refine``
then recomputes the rules, weights and statistics of the micro-batch from it.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from slime_tis.core.correction import TISResult
from slime_tis.core.ratios import Ratios

__all__ = ["decision_part"]

_TOKEN = ("valid", "token_ok", "log_ratio", "prefix_sum_log_ratio", "prefix_min_log_ratio")  # the prefix: optional
_SEQUENCE = ("seq_has_tokens", "seq_nonfinite", "seq_ok", "seq_count", "seq_log_ratio_sum", "seq_log_ratio_mean",
             "seq_mean_lp_train", "seq_mean_lp_rollout", "seq_sums", "local_sums")
_OTHER = ("seq_id", "columns", "token_columns")
_OPTIONAL = ("lp_rollout", "staleness", "bound_scale")  # None, or per token, per sequence, (per token, per sequence)


def decision_part(decided: TISResult, sequences: Tensor, tokens: Tensor, seq_id: Tensor) -> TISResult:
    """``decided`` restricted to ``sequences`` ``[n]`` (int64, indices into its sequences) and their ``tokens``
    ``[T']`` (int64, indices into its packed tokens, sequence by sequence); ``seq_id`` ``[T']``: each token's
    sequence in the part (0 .. n - 1). For ``refine`` (which reads the ratios): the part's statistics and
    batch-normalisation sums are not split, they are the whole batch's."""
    unknown = {f.name for f in dataclasses.fields(Ratios)} ^ set(_TOKEN + _SEQUENCE + _OTHER + _OPTIONAL)
    if unknown:
        raise TypeError(f"decision_part does not know the Ratios fields {sorted(unknown)}")
    r = decided.ratios
    part = dataclasses.replace(
        r, seq_id=seq_id, token_columns={k: v[tokens] for k, v in r.token_columns.items()},
        **{k: None if getattr(r, k) is None else getattr(r, k)[tokens] for k in _TOKEN},
        **{k: getattr(r, k)[sequences] for k in _SEQUENCE},
        lp_rollout=None if r.lp_rollout is None else r.lp_rollout[tokens],
        staleness=None if r.staleness is None else r.staleness[sequences],
        bound_scale=None if r.bound_scale is None else (r.bound_scale[0][tokens], r.bound_scale[1][sequences]))
    at = {k: None if getattr(decided, k) is None else getattr(decided, k)[tokens]
          for k in ("weights", "keep_mask", "loss_keep", "loss_ok")}
    seq_loss = None if decided.seq_loss_nonfinite is None else decided.seq_loss_nonfinite[sequences]
    return dataclasses.replace(decided, ratios=part, verdict=None, seq_loss_nonfinite=seq_loss, **at)
