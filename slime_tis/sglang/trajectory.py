"""Multi-turn trajectories and batches of parsed SGLang responses.

A trajectory concatenates each turn's generated tokens (trainable) and the tool / environment tokens between turns
(``loss_mask = 0``, rollout log-prob 0, ignored): slime's ``Sample.append_response_tokens``. :func:`collate` packs a
batch into the core's layout and counts the rejections in ``sglang/*`` metrics (docs/sglang.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .response import (
    FINISH_ERROR_METRICS,
    OnError,
    RolloutLogprobs,
    RolloutTokens,
    SGLangLogprobError,
    parse_generate_response,
)
from .support import SUPPORT_INVALID_METRIC, SamplingSupport

__all__ = ["READER_METRICS", "PackedRollouts", "TrajectoryBuilder", "collate"]

#: The reader's per-batch fractions (``collate``): sequences rejected for any reason, misaligned, non-finite.
READER_METRICS = ("sglang/rejected_seq_fraction", "sglang/misaligned_seq_fraction", "sglang/nonfinite_seq_fraction")


class TrajectoryBuilder:
    """One multi-turn response, turn by turn (docs/sglang.md); the keyword arguments go to
    :func:`parse_generate_response` for every turn. A rejected turn rejects the trajectory (reasons prefixed with
    the turn number); a misaligned or unfinished / aborted turn masks all of it."""

    def __init__(
        self,
        *,
        on_error: OnError = "reject",
        sampling_params: Mapping[str, Any] | None = None,
        renormalized_logprobs: bool | None = None,
        rollout_logprobs: RolloutLogprobs = "full",
        sampling_support: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        self._parse = dict(on_error=on_error, sampling_params=sampling_params,
                           renormalized_logprobs=renormalized_logprobs, rollout_logprobs=rollout_logprobs,
                           sampling_support=sampling_support, vocab_size=vocab_size)
        self._parts: list[RolloutTokens] = []
        self._turn = 0

    def add_response(self, response: Mapping[str, Any]) -> RolloutTokens:
        """Append one ``/generate`` response (non-streaming, or merged with ``merge_stream_chunks``)."""
        parsed = parse_generate_response(response, **self._parse)
        parsed.reasons = [f"turn {self._turn}: {r}" for r in parsed.reasons]
        self._turn += 1
        self._parts.append(parsed)
        return parsed

    def add_tokens(self, token_ids: Sequence[int] | Tensor) -> None:
        """Append tool/environment tokens: ``loss_mask = 0``, no rollout log-prob (0.0, ignored)."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        zeros = torch.zeros(ids.numel(), dtype=torch.float32)
        self._parts.append(RolloutTokens(
            token_ids=ids, rollout_log_probs=zeros, loss_mask=zeros.clone(),
            support=SamplingSupport.empty_rows(ids.numel()) if self._parse["sampling_support"] else None,
            rollout_log_mass=zeros.clone() if self._parse["rollout_logprobs"] == "sampling" else None,
        ))

    def build(self) -> RolloutTokens:
        """The whole response so far as one :class:`RolloutTokens`."""
        if not self._parts:
            raise SGLangLogprobError("empty trajectory: add at least one response")
        out = _concat(self._parts)
        if out.misaligned or out.finish_error:
            # one misaligned turn shifts every later token, and a turn that did not finish broke the
            # conversation after it: nothing of this trajectory is trustworthy
            out.loss_mask.zero_()
        return out


def _concat(parts: Sequence[RolloutTokens]) -> RolloutTokens:
    """``parts`` one after the other: the flags of any, the reasons of all, a support or kept mass where all have."""
    def cat(name: str) -> Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else torch.cat(values)

    supports = [p.support for p in parts]
    return RolloutTokens(
        cat("token_ids"), cat("rollout_log_probs"), cat("loss_mask"), rejected=any(p.rejected for p in parts),
        misaligned=any(p.misaligned for p in parts), nonfinite=any(p.nonfinite for p in parts),
        finish_error=next((p.finish_error for p in parts if p.finish_error), None),
        reasons=[r for p in parts for r in p.reasons], support_invalid=any(p.support_invalid for p in parts),
        support=None if any(x is None for x in supports) else SamplingSupport.from_lengths(
            torch.cat([x.ids for x in supports]), torch.cat([x.offsets.diff() for x in supports])),
        rollout_log_mass=cat("rollout_log_mass"))


@dataclass
class PackedRollouts:
    """A batch in the core's packed layout: ``token_ids [T]`` int64, ``rollout_log_probs [T]`` and ``loss_mask
    [T]`` float32, ``cu_seqlens [n + 1]`` int64, ``rejected [n]`` bool and the ``reasons`` of each sequence,
    ``metrics`` (``sglang/*`` fractions, scalar float32 tensors); ``support_ids [S]`` int32 / ``support_offsets
    [T + 1]`` int64 (token ``t`` keeps ``support_ids[support_offsets[t]:support_offsets[t + 1]]``) and
    ``rollout_log_mass [T]`` float32 when every sample carries them, else ``None``."""

    token_ids: Tensor
    rollout_log_probs: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor
    rejected: Tensor
    reasons: list[list[str]] = field(default_factory=list)
    metrics: dict[str, Tensor] = field(default_factory=dict)
    support_ids: Tensor | None = None
    support_offsets: Tensor | None = None
    rollout_log_mass: Tensor | None = None


def collate(samples: Sequence[RolloutTokens]) -> PackedRollouts:
    """Pack parsed responses into ``[T]`` tensors + ``cu_seqlens`` and count the rejections."""
    if not samples:
        raise ValueError("collate needs at least one sample, got an empty list")
    with_support = [s.support is not None for s in samples]
    if any(with_support) and not all(with_support):
        raise ValueError("collate: some samples carry a sampling support and some do not; parse them all with "
                         "the same sampling_support setting")
    whole = _concat(samples)

    def fraction(values: list[bool]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32).mean()

    flags = ("rejected", "misaligned", "nonfinite")
    metrics = {name: fraction([getattr(s, flag) for s in samples]) for name, flag in zip(READER_METRICS, flags)}
    metrics.update({name: fraction([s.finish_error == kind for s in samples])
                    for kind, name in FINISH_ERROR_METRICS.items()})
    if whole.support is not None:
        metrics[SUPPORT_INVALID_METRIC] = fraction([s.support_invalid for s in samples])
    lengths = torch.tensor([s.length for s in samples], dtype=torch.int64)
    support_ids, support_offsets = (None, None) if whole.support is None else (whole.support.ids, whole.support.offsets)
    return PackedRollouts(
        whole.token_ids, whole.rollout_log_probs, whole.loss_mask,
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]),
        rejected=torch.tensor([s.rejected for s in samples], dtype=torch.bool),
        reasons=[list(s.reasons) for s in samples], metrics=metrics, support_ids=support_ids,
        support_offsets=support_offsets, rollout_log_mass=whole.rollout_log_mass)
