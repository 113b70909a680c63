"""SGLang ``/generate`` responses -> aligned rollout log-prob tensors (+ the top-p/top-k guard).

Typical use (one request per sample, ``return_logprob`` on)::

    from slime_tis.sglang import generate_request, parse_generate_response, collate

    req = generate_request(prompt_ids, {"temperature": 1.0, "max_new_tokens": 256})  # checks top-p
    resp = requests.post(f"{url}/generate", json=req).json()
    sample = parse_generate_response(resp)          # RolloutTokens: token_ids, rollout_log_probs, loss_mask
    batch = collate([sample, ...])                  # packed [T] tensors + cu_seqlens + sglang/* metrics

Mixture of experts: ``parse_routed_experts(meta_info["routed_experts"], ...)`` (``return_routed_experts``) gives
the engine's experts per token and MoE layer for rollout routing replay (``--tis-routing-replay``).

Streaming: ``merge_stream_chunks(lines)`` first; multi-turn with tool tokens: ``TrajectoryBuilder``.
Top-p / top-k sampling: ``generate_request(..., sampling_logprobs=True)`` and
``parse_generate_response(resp, rollout_logprobs="sampling")`` use SGLang's log-probs of the
truncated distribution (``output_token_sampling_logprobs``) as pi_rollout; add ``sampling_support=True,
vocab_size=V`` to carry each token's kept ids (``output_token_sampling_mask``, or slime's top-p token ids) in
the batch (``PackedRollouts.support_ids`` / ``support_offsets``) for the trainer's replay of the same support.
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
    reset_sampling_warnings,
)
from .stream import TOKEN_LISTS, merge_stream_batch, merge_stream_chunks
from .support import SUPPORT_INVALID_METRIC, SamplingSupport, read_support, validate_support
from .trajectory import PackedRollouts, TrajectoryBuilder, collate

__all__ = [
    "ENV_RENORMALIZED",
    "REPLAY_PARAM",
    "FINISH_ERROR_METRICS",
    "NAN_STOP",
    "PackedRollouts",
    "RolloutTokens",
    "SGLangLogprobError",
    "SamplingCheck",
    "SamplingSupport",
    "SUPPORT_INVALID_METRIC",
    "TOKEN_LISTS",
    "TOP_K_ALL",
    "TrajectoryBuilder",
    "TruncatedSamplingWarning",
    "check_sampling_params",
    "collate",
    "generate_request",
    "merge_stream_batch",
    "merge_stream_chunks",
    "parse_generate_response",
    "parse_routed_experts",
    "read_support",
    "reset_sampling_warnings",
    "validate_support",
]


def generate_request(
    input_ids: Sequence[int],
    sampling_params: Mapping[str, Any] | None = None,
    *,
    stream: bool = False,
    renormalized_logprobs: bool | None = None,
    sampling_logprobs: bool = False,
) -> dict[str, Any]:
    """The JSON body of an SGLang ``/generate`` request that returns output-token log-probs.

    Sets ``return_logprob = True`` and ``logprob_start_len = -1`` (output tokens only) and checks the
    sampling params for the top-p/top-k/min-p bias (warns once, see :func:`check_sampling_params`).
    ``sampling_logprobs=True`` also sets ``return_sampling_mask = True``: SGLang (>= 0.5.23) then
    returns ``meta_info.output_token_sampling_logprobs``, the log-probs under the truncated
    distribution the tokens were drawn from; parse with ``rollout_logprobs="sampling"`` to use them
    as pi_rollout (the top-p check does not warn then).
    """
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids must contain at least one prompt token, got an empty list")
    params = dict(sampling_params or {})
    check_sampling_params(params, renormalized_logprobs=True if sampling_logprobs else renormalized_logprobs)
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": bool(stream),
    }
    if sampling_logprobs:
        body["return_sampling_mask"] = True
    return body
