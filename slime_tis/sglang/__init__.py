"""SGLang ``/generate`` responses -> aligned rollout log-prob tensors, with the top-p / top-k guard.

A leaf of the package (imports torch only). Use, checks and streams: docs/sglang.md; supports: docs/sampling_support.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .response import FINISH_ERROR_METRICS, NAN_STOP, RolloutTokens, SGLangLogprobError, parse_generate_response
from .routing import parse_routed_experts
from .sampling import (
    ENV_RENORMALIZED,
    REPLAY_PARAM,
    TOP_K_ALL,
    SamplingCheck,
    TruncatedSamplingWarning,
    check_sampling_params,
)
from .stream import TOKEN_LISTS, merge_stream_batch, merge_stream_chunks
from .support import SUPPORT_INVALID_METRIC, SamplingSupport, read_support, validate_support
from .trajectory import PackedRollouts, TrajectoryBuilder, collate

__all__ = [
    "ENV_RENORMALIZED", "REPLAY_PARAM", "FINISH_ERROR_METRICS", "NAN_STOP", "PackedRollouts", "RolloutTokens",
    "SGLangLogprobError", "SamplingCheck", "SamplingSupport", "SUPPORT_INVALID_METRIC", "TOKEN_LISTS", "TOP_K_ALL",
    "TrajectoryBuilder", "TruncatedSamplingWarning", "check_sampling_params", "collate", "generate_request",
    "merge_stream_batch", "merge_stream_chunks", "parse_generate_response", "parse_routed_experts", "read_support",
    "validate_support"
]


def generate_request(input_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None, *,
                     stream: bool = False, renormalized_logprobs: bool | None = None,
                     sampling_logprobs: bool = False) -> dict[str, Any]:
    """The JSON body of a ``/generate`` request returning output-token log-probs (``return_logprob``,
    ``logprob_start_len = -1``), its sampling params checked (:func:`check_sampling_params`).
    ``sampling_logprobs=True`` adds ``return_sampling_mask`` (SGLang >= 0.5.23: the truncated distribution's
    log-probs; parse with ``rollout_logprobs="sampling"``, no top-p warning then)."""
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids must contain at least one prompt token, got an empty list")
    params = dict(sampling_params or {})
    check_sampling_params(params, renormalized_logprobs=True if sampling_logprobs else renormalized_logprobs)
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1,
            "stream": bool(stream)}
    return {**body, "return_sampling_mask": True} if sampling_logprobs else body
