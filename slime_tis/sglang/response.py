"""Parse one SGLang ``/generate`` response into aligned rollout log-probs and token ids.

SGLang's native ``/generate`` with ``"return_logprob": true`` answers (per request)::

    {"text": "...", "output_ids": [id_0, ..., id_{R-1}],
     "meta_info": {"output_token_logprobs": [[lp_0, id_0, text_or_null], ..., [lp_{R-1}, id_{R-1}, ...]],
                   "output_token_logprobs_length": R, "completion_tokens": R, "prompt_tokens": P,
                   "input_token_logprobs": [...], "finish_reason": {...}, "id": "..."}}

Entry ``t`` of ``output_token_logprobs`` is the log-prob of generated token ``t`` (after
temperature scaling, ignoring top-p/top-k), and its id. Training uses **these** ids (never
re-tokenised text) and these log-probs, token for token: ``rollout_log_probs[t] = lp_t``.

Checks (each failure rejects the sequence and records a reason; ``on_error="raise"`` raises
:class:`SGLangLogprobError` with the same message instead):

* alignment (the classic off-by-one): ``len(output_token_logprobs)`` must equal
  ``output_token_logprobs_length``, ``completion_tokens`` and ``len(output_ids)`` when those are
  present, and the ids must equal ``output_ids`` element-wise; a one-position shift is named as
  such. A misaligned sequence gets ``loss_mask = 0`` everywhere and NaN log-probs.
* values: a ``None``, NaN, +-inf or positive (> ``logprob_tolerance``) log-prob at a generated token
  is replaced by NaN and the sequence is marked rejected; the NaN makes the core reject it (and count
  it in ``tis/nonfinite_seq_fraction``), while the loss mask and the denominator stay as they were.

A response without ``meta_info.output_token_logprobs`` (request sent without ``return_logprob``)
or with entries that are not ``[logprob, token_id, ...]`` is a usage error and always raises.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from .sampling import check_sampling_params

__all__ = [
    "RolloutTokens",
    "SGLangLogprobError",
    "parse_generate_response",
]

logger = logging.getLogger("slime_tis.sglang")

OnError = Literal["reject", "raise"]


class SGLangLogprobError(ValueError):
    """An SGLang response cannot be turned into aligned rollout log-probs."""


@dataclass
class RolloutTokens:
    """One response (one turn, or a whole multi-turn trajectory) aligned for training.

    Attributes:
        token_ids: ``[R]`` int64 response token ids (from ``output_token_logprobs``; tool tokens
            as given).
        rollout_log_probs: ``[R]`` float32; NaN where SGLang gave no usable value; 0.0 at
            tool/environment tokens (mask 0, ignored).
        loss_mask: ``[R]`` float32 0/1; 1 = generated token to train on.
        rejected: the sequence failed a check (see ``reasons``).
        misaligned: rejected for a length/alignment error (mask zeroed).
        nonfinite: rejected for a None/NaN/inf/positive log-prob (NaN placed, mask kept).
        reasons: human-readable reasons, one per failed check.
    """

    token_ids: Tensor
    rollout_log_probs: Tensor
    loss_mask: Tensor
    rejected: bool = False
    misaligned: bool = False
    nonfinite: bool = False
    reasons: list[str] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())


def _entries(meta: Mapping[str, Any]) -> list[Sequence[Any]]:
    if "output_token_logprobs" not in meta:
        raise SGLangLogprobError(
            "response meta_info has no 'output_token_logprobs': send the /generate request with "
            "\"return_logprob\": true (keys present: " + ", ".join(sorted(map(str, meta))) + ")"
        )
    entries = meta["output_token_logprobs"]
    if not isinstance(entries, (list, tuple)):
        raise SGLangLogprobError(
            f"meta_info['output_token_logprobs'] must be a list of [logprob, token_id, text], "
            f"got {type(entries).__name__}"
        )
    for t, e in enumerate(entries):
        if not isinstance(e, (list, tuple)) or len(e) < 2:
            raise SGLangLogprobError(
                f"output_token_logprobs[{t}] must be [logprob, token_id, text_or_null], got {e!r}"
            )
        if isinstance(e[1], bool) or not isinstance(e[1], int):
            raise SGLangLogprobError(f"output_token_logprobs[{t}] has a non-integer token id {e[1]!r}")
    return list(entries)


def _shift_hint(ids: list[int], output_ids: list[int]) -> str:
    """Name a one-position misalignment between the log-prob ids and ``output_ids``, if that is what it is."""
    if len(ids) == len(output_ids) >= 2 and (ids[1:] == output_ids[:-1] or ids[:-1] == output_ids[1:]):
        return " (the two lists are shifted by one position: off-by-one)"
    if abs(len(ids) - len(output_ids)) == 1:
        longer_name = "output_ids" if len(output_ids) > len(ids) else "output_token_logprobs"
        short, long = (ids, output_ids) if len(output_ids) > len(ids) else (output_ids, ids)
        if short == long[1:]:
            return f" ({longer_name} has one extra token at the start: off-by-one)"
        if short == long[:-1]:
            return f" ({longer_name} has one extra token at the end: off-by-one)"
    return ""


def _alignment_errors(meta: Mapping[str, Any], response: Mapping[str, Any], ids: list[int]) -> list[str]:
    n = len(ids)
    errors = []
    for key in ("output_token_logprobs_length", "completion_tokens"):
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value != n:
            errors.append(f"len(output_token_logprobs) = {n} but meta_info['{key}'] = {value}")
    output_ids = response.get("output_ids")
    if isinstance(output_ids, (list, tuple)):
        output_ids = list(output_ids)
        if len(output_ids) != n:
            errors.append(
                f"len(output_token_logprobs) = {n} but len(output_ids) = {len(output_ids)}"
                + _shift_hint(ids, output_ids)
            )
        elif output_ids != ids:
            first = next(t for t in range(n) if output_ids[t] != ids[t])
            errors.append(
                f"token ids of output_token_logprobs differ from output_ids at position {first} "
                f"({ids[first]} vs {output_ids[first]})" + _shift_hint(ids, output_ids)
            )
    return errors


def _value_errors(values: list[Any], tolerance: float) -> tuple[list[float], list[str]]:
    out: list[float] = []
    bad: dict[str, list[int]] = {}
    for t, v in enumerate(values):
        if v is None:
            bad.setdefault("None", []).append(t)
            out.append(math.nan)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            bad.setdefault("non-numeric", []).append(t)
            out.append(math.nan)
            continue
        v = float(v)
        if math.isnan(v):
            bad.setdefault("NaN", []).append(t)
            out.append(math.nan)
        elif math.isinf(v):
            bad.setdefault("infinite", []).append(t)
            out.append(math.nan)
        elif v > tolerance:
            bad.setdefault("positive", []).append(t)
            out.append(math.nan)
        else:
            out.append(v)
    reasons = []
    for kind, where in bad.items():
        shown = ", ".join(map(str, where[:5])) + (", ..." if len(where) > 5 else "")
        reasons.append(f"{len(where)} {kind} log-prob(s) at generated token(s) {shown}")
    return out, reasons


def parse_generate_response(
    response: Mapping[str, Any],
    *,
    on_error: OnError = "reject",
    sampling_params: Mapping[str, Any] | None = None,
    renormalized_logprobs: bool | None = None,
    logprob_tolerance: float = 1e-4,
) -> RolloutTokens:
    """Turn one ``/generate`` response (a dict, as returned by ``requests.post(...).json()``) into
    :class:`RolloutTokens` (all tokens trainable, ``loss_mask = 1``).

    Args:
        response: the response dict of one request (for a batched request, parse each element).
        on_error: ``"reject"`` (default) marks the sequence rejected and logs the reason;
            ``"raise"`` raises :class:`SGLangLogprobError`.
        sampling_params: the request's sampling params; when given they are checked for top-p /
            top-k / min-p bias (:func:`check_sampling_params`, warns once).
        renormalized_logprobs: forwarded to :func:`check_sampling_params`.
        logprob_tolerance: log-probs above this value are invalid (a log-prob is <= 0).
    """
    if on_error not in ("reject", "raise"):
        raise ValueError(f"on_error must be 'reject' or 'raise', got {on_error!r}")
    if not isinstance(response, Mapping):
        raise TypeError(f"response must be a dict (one /generate result), got {type(response).__name__}")
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        raise SGLangLogprobError(
            f"response has no 'meta_info' dict (keys: {sorted(map(str, response))}); "
            "is this an SGLang /generate response?"
        )
    if sampling_params is not None:
        check_sampling_params(sampling_params, renormalized_logprobs=renormalized_logprobs)

    entries = _entries(meta)
    ids = [int(e[1]) for e in entries]
    values, value_reasons = _value_errors([e[0] for e in entries], logprob_tolerance)
    align_reasons = _alignment_errors(meta, response, ids)
    reasons = align_reasons + value_reasons
    rid = meta.get("id")
    if reasons and on_error == "raise":
        raise SGLangLogprobError(f"request {rid!r}: " + "; ".join(reasons))

    token_ids = torch.tensor(ids, dtype=torch.int64)
    log_probs = torch.tensor(values, dtype=torch.float32)
    mask = torch.ones(len(ids), dtype=torch.float32)
    if align_reasons:
        mask.zero_()
        log_probs.fill_(math.nan)
    if reasons:
        logger.warning("rejecting SGLang response %r: %s", rid, "; ".join(reasons))
    return RolloutTokens(
        token_ids=token_ids,
        rollout_log_probs=log_probs,
        loss_mask=mask,
        rejected=bool(reasons),
        misaligned=bool(align_reasons),
        nonfinite=bool(value_reasons),
        reasons=reasons,
    )
