"""Multi-turn trajectories and batching of parsed SGLang responses.

A multi-turn (agentic) response is the concatenation, after the prompt, of the tokens the model
generated in each turn (trainable, log-probs from ``output_token_logprobs``) and of the tokens the
tool/environment inserted between turns (not trainable: ``loss_mask = 0``, no rollout log-prob,
stored as 0.0 and ignored). This is slime's ``Sample.append_response_tokens`` convention.

:func:`collate` packs a batch into the core's layout (``[T]`` tensors + ``cu_seqlens``) and counts
rejections: ``sglang/rejected_seq_fraction`` (any reason), ``sglang/misaligned_seq_fraction``
(length/alignment errors: whole sequence masked), ``sglang/nonfinite_seq_fraction``
(None/NaN/inf/positive log-probs: NaN placed so that the core rejects the sequence), and the
requests that did not finish normally (whole sequence masked): ``sglang/unfinished_seq_fraction``
(``finish_reason`` null: a stream cut off before its finishing chunk), ``sglang/aborted_seq_fraction``
(``finish_reason`` abort) and ``sglang/nan_stop_seq_fraction`` (SGLang's "NaN happened" stop); parsed with
``sampling_support=True``, the batch carries the packed supports and ``sglang/support_invalid_seq_fraction``
counts the sequences rejected for an invalid support row (:mod:`slime_tis.sglang.support`).
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
from .support import SUPPORT_INVALID_METRIC, SamplingSupport, concat_supports

__all__ = ["READER_METRICS", "PackedRollouts", "TrajectoryBuilder", "collate"]

#: The reader's per-batch fractions (``collate``): sequences rejected for any reason, misaligned, non-finite.
READER_METRICS = ("sglang/rejected_seq_fraction", "sglang/misaligned_seq_fraction", "sglang/nonfinite_seq_fraction")


class TrajectoryBuilder:
    """Build one multi-turn response, turn by turn.

    Example::

        traj = TrajectoryBuilder()
        traj.add_response(resp_turn_1)             # generated: mask 1, SGLang log-probs
        traj.add_tokens(tool_output_ids)           # environment: mask 0
        traj.add_response(resp_turn_2)
        sample = traj.build()                      # RolloutTokens over the whole response

    A rejected turn rejects the whole trajectory (its reasons are prefixed with the turn number); a
    misaligned or unfinished/aborted turn masks all of it. Keyword arguments go to
    :func:`parse_generate_response` for every turn.
    """

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
        self.sampling_support, self.vocab_size = sampling_support, vocab_size
        self.on_error = on_error
        self.sampling_params = sampling_params
        self.renormalized_logprobs = renormalized_logprobs
        self.rollout_logprobs = rollout_logprobs
        self._parts: list[RolloutTokens] = []
        self._turn = 0

    def add_response(self, response: Mapping[str, Any]) -> RolloutTokens:
        """Append one ``/generate`` response (non-streaming, or merged with ``merge_stream_chunks``)."""
        parsed = parse_generate_response(
            response,
            on_error=self.on_error,
            sampling_params=self.sampling_params,
            renormalized_logprobs=self.renormalized_logprobs,
            rollout_logprobs=self.rollout_logprobs,
            sampling_support=self.sampling_support,
            vocab_size=self.vocab_size,
        )
        parsed.reasons = [f"turn {self._turn}: {r}" for r in parsed.reasons]
        self._turn += 1
        self._parts.append(parsed)
        return parsed

    def add_tokens(self, token_ids: Sequence[int] | Tensor) -> None:
        """Append tool/environment tokens: ``loss_mask = 0``, no rollout log-prob (0.0, ignored)."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        n = ids.numel()
        self._parts.append(
            RolloutTokens(
                token_ids=ids,
                rollout_log_probs=torch.zeros(n, dtype=torch.float32),
                loss_mask=torch.zeros(n, dtype=torch.float32),
                support=SamplingSupport.empty_rows(n) if self.sampling_support else None,
                rollout_log_mass=torch.zeros(n, dtype=torch.float32) if self.rollout_logprobs == "sampling" else None,
            )
        )

    def build(self) -> RolloutTokens:
        """The whole response so far as one :class:`RolloutTokens`."""
        if not self._parts:
            raise SGLangLogprobError("empty trajectory: add at least one response")
        parts = self._parts
        out = RolloutTokens(
            token_ids=torch.cat([p.token_ids for p in parts]),
            rollout_log_probs=torch.cat([p.rollout_log_probs for p in parts]),
            loss_mask=torch.cat([p.loss_mask for p in parts]),
            rejected=any(p.rejected for p in parts),
            misaligned=any(p.misaligned for p in parts),
            nonfinite=any(p.nonfinite for p in parts),
            finish_error=next((p.finish_error for p in parts if p.finish_error), None),
            reasons=[r for p in parts for r in p.reasons],
            support=concat_supports([p.support for p in parts]) if self.sampling_support else None,
            support_invalid=any(p.support_invalid for p in parts),
            rollout_log_mass=(torch.cat([p.rollout_log_mass for p in parts])
                              if all(p.rollout_log_mass is not None for p in parts) else None),
        )
        if out.misaligned or out.finish_error:
            # one misaligned turn shifts every later token, and a turn that did not finish broke the
            # conversation after it: nothing of this trajectory is trustworthy
            out.loss_mask.zero_()
        return out


@dataclass
class PackedRollouts:
    """A batch of responses in the core's packed layout.

    Attributes:
        token_ids: ``[T]`` int64. rollout_log_probs: ``[T]`` float32. loss_mask: ``[T]`` float32.
        cu_seqlens: ``[n + 1]`` int64. rejected: ``[n]`` bool. reasons: per sequence, a list of str.
        metrics: ``sglang/*`` fractions (scalar float32 tensors).
        support_ids: ``[S]`` int32, support_offsets: ``[T + 1]`` int64: every token's sampling support (CSR, token
            ``t`` keeps ``support_ids[support_offsets[t]:support_offsets[t + 1]]``), when every sample carries one;
            else ``None``.
        rollout_log_mass: ``[T]`` float32 (``RolloutTokens.rollout_log_mass``) when every sample carries it, else
            ``None``.
    """

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

    def per_sample(self) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """slime-style per-sample lists ``(token_ids, rollout_log_probs, loss_masks)``."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()  # host-sync-ok (CPU, data prep)
        return (
            list(self.token_ids.split(lengths)),
            list(self.rollout_log_probs.split(lengths)),
            list(self.loss_mask.split(lengths)),
        )


def collate(samples: Sequence[RolloutTokens]) -> PackedRollouts:
    """Pack parsed responses into ``[T]`` tensors + ``cu_seqlens`` and count the rejections."""
    n = len(samples)
    if n == 0:
        raise ValueError("collate needs at least one sample, got an empty list")
    lengths = torch.tensor([s.length for s in samples], dtype=torch.int64)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    rejected = torch.tensor([s.rejected for s in samples], dtype=torch.bool)
    misaligned = torch.tensor([s.misaligned for s in samples], dtype=torch.bool)
    nonfinite = torch.tensor([s.nonfinite for s in samples], dtype=torch.bool)
    with_support = [s.support is not None for s in samples]
    if any(with_support) and not all(with_support):
        raise ValueError("collate: some samples carry a sampling support and some do not; parse them all with "
                         "the same sampling_support setting")
    support = concat_supports([s.support for s in samples]) if all(with_support) else None
    support_invalid = torch.tensor([s.support_invalid for s in samples], dtype=torch.float32)
    finish = {
        name: torch.tensor([s.finish_error == kind for s in samples], dtype=torch.float32).mean()
        for kind, name in FINISH_ERROR_METRICS.items()
    }
    return PackedRollouts(
        token_ids=torch.cat([s.token_ids for s in samples]),
        rollout_log_probs=torch.cat([s.rollout_log_probs for s in samples]),
        loss_mask=torch.cat([s.loss_mask for s in samples]),
        cu_seqlens=cu,
        rejected=rejected,
        reasons=[list(s.reasons) for s in samples],
        metrics={
            **dict(zip(READER_METRICS, (rejected.float().mean(), misaligned.float().mean(),
                                        nonfinite.float().mean()))),
            **finish,
            **({SUPPORT_INVALID_METRIC: support_invalid.mean()} if support is not None else {}),
        },
        support_ids=None if support is None else support.ids,
        support_offsets=None if support is None else support.offsets,
        rollout_log_mass=(torch.cat([s.rollout_log_mass for s in samples])
                          if all(s.rollout_log_mass is not None for s in samples) else None),
    )
