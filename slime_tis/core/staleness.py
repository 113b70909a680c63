"""Staleness (docs/semantics.md, "Staleness"): the ``tis/staleness_<b>/*`` statistics per bucket
``b = min(floor(s_i), N)`` (labels ``0 .. N-1``, ``<N>plus``; invalid ``s``: no bucket, counted) and the bounds'
factor ``gamma^s``. Every bucket is present (zero-filled): the keys depend on ``N`` only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["bucket_labels", "staleness_statistics", "check_staleness", "bound_scale"]

F64 = torch.float64
#: the token statistics of a bucket (``tis.staleness_<b>.<name>``), the rows of one ``[7, T]`` block
TOKEN_STATISTICS = ("n_tok_valid", "n_tok", "kl_sum", "k3_sum", "n_tok_rejected", "n_tok_kept", "w_sum")


def bucket_labels(n: int) -> list[str]:
    """The labels of the ``n + 1`` buckets: ``"0", ..., "<n-1>", "<n>plus"``."""
    return [str(b) for b in range(n)] + [f"{n}plus"]


def check_staleness(staleness: Any, n_seq: int, device: torch.device) -> Tensor:
    """``staleness`` checked as a ``[n_seq]`` real tensor on ``device`` (``ValueError`` naming it)."""
    if not isinstance(staleness, Tensor):
        raise ValueError(f"staleness must be a [n_seq] tensor, one value per sequence, got {type(staleness).__name__}")
    if tuple(staleness.shape) != (n_seq,):
        raise ValueError(f"staleness has shape {tuple(staleness.shape)}, expected ({n_seq},): one value per sequence")
    if staleness.device != device:
        raise ValueError(f"staleness is on {staleness.device}, the log-probs on {device}")
    if staleness.dtype == torch.bool or staleness.is_complex():
        raise ValueError(f"staleness must be an integer or float tensor, got {staleness.dtype}")
    return staleness


def _valid(staleness: Tensor) -> tuple[Tensor, Tensor]:
    """``(ok, s)``: the valid staleness (finite, ``>= 0``) and the float64 values, 0 where not valid."""
    s = staleness.to(F64)
    ok = torch.isfinite(s) & (s >= 0)
    return ok, torch.where(ok, s, 0.0)


def bound_scale(plan: Any, staleness: Tensor) -> Tensor:
    """``[n_seq]`` float32 ``gamma^s`` of each sequence (0 for an invalid staleness)."""
    ok, s = _valid(staleness)
    return torch.where(ok, torch.pow(plan.staleness_decay, s), 0.0).float()


def _buckets(staleness: Tensor, n: int) -> Tensor:
    """``[n_seq]`` int64 bucket ``min(floor(s), n)`` of each sequence, ``n + 1`` for an invalid staleness."""
    ok, s = _valid(staleness)
    return torch.where(ok, s.clamp(max=float(n)).floor(), float(n + 1)).long()


def staleness_statistics(batch: Any, groups: dict[str, dict[str, Tensor]]) -> None:
    """Add the per-bucket statistics of a ``TisContext`` to ``groups`` (by ``MetricStats`` field): one
    ``index_add`` of the token block and one of the sequence counts."""
    plan, r, verdict = batch.plan, batch.ratios, batch.verdict
    n = plan.staleness_buckets
    seq_bucket = _buckets(r.staleness, n)
    token_bucket = seq_bucket.index_select(0, r.seq_id)
    kept = verdict.keep
    weights = batch.kept_weights.index_select(0, r.seq_id) if plan.per_sequence else batch.kept_weights
    block = torch.stack([r.valid.to(F64), r.token_ok.to(F64), -r.log_ratio.to(F64), batch.k3.to(F64),
                         (r.valid & ~kept).to(F64), kept.to(F64), torch.where(kept, weights, 0.0).to(F64)])
    token = torch.zeros((len(TOKEN_STATISTICS), n + 2), dtype=F64, device=block.device)
    token.index_add_(1, token_bucket, block)
    seq = torch.zeros(n + 2, dtype=F64, device=block.device).index_add_(0, seq_bucket, r.seq_ok.to(F64))
    for b, label in enumerate(bucket_labels(n)):
        for j, name in enumerate(TOKEN_STATISTICS):
            groups["token_sums"][f"tis.staleness_{label}.{name}"] = token[j, b]
        groups["seq_sums"][f"tis.staleness_{label}.n_seq"] = seq[b]
    invalid = (seq_bucket == n + 1) & r.seq_has_tokens
    groups["seq_sums"]["tis.staleness_invalid"] = invalid.sum(dtype=F64)
