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

* finish: ``meta_info.finish_reason`` must say the request finished normally. Rejected (whole
  sequence masked, NaN log-probs, like a misalignment): ``null`` (the request had not finished: a
  stream cut off before its finishing chunk, or a request of a batched stream that sent no chunk), a value
  that is no finish reason (``false``, ``0``, ``{}``, ``""``: counted as unfinished), ``{"type": "abort",
  "message": ...}`` (SGLang aborted
  it; the message is kept in the reason) and ``{"type": "stop", "matched": "NaN happened"}`` (SGLang's
  stop when the sampler produced a token id outside the vocabulary, i.e. NaN/inf logits; the last
  token was replaced by the stop token). A response without the key is not checked.

pi_rollout: by default SGLang's ``output_token_logprobs`` (full temperature-scaled distribution).
With ``rollout_logprobs="sampling"`` the log-probs of the distribution the token was actually
drawn from (after top-p / top-k / min-p, renormalised over the kept support) are used instead:
``meta_info.output_token_sampling_logprobs``, returned by SGLang >= 0.5.23 when the request sets
``"return_sampling_mask": true`` (one float per token in its default ``sampling_logprobs_mode``
``"selected"``; in ``"support"`` mode one list per token over ``output_token_sampling_mask[t]``,
from which the sampled token's entry is taken).

A response without ``meta_info.output_token_logprobs`` (request sent without ``return_logprob``)
or with entries that are not ``[logprob, token_id, ...]`` is a usage error and always raises, as
does ``rollout_logprobs="sampling"`` on a response without ``output_token_sampling_logprobs``.
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
from .support import SamplingSupport, read_support, validate_support

__all__ = [
    "FINISH_ERROR_METRICS",
    "NAN_STOP",
    "RolloutTokens",
    "SGLangLogprobError",
    "is_finish_reason",
    "parse_generate_response",
]

logger = logging.getLogger("slime_tis.sglang")

OnError = Literal["reject", "raise"]
RolloutLogprobs = Literal["full", "sampling"]

#: SGLang's ``finish_reason`` for a NaN/inf sampler output (``schedule_batch.py``, ``FINISH_MATCHED_STR``).
NAN_STOP = "NaN happened"

#: Finish errors -> the metric that counts them (``collate``); one place for the names.
FINISH_ERROR_METRICS = {
    "unfinished": "sglang/unfinished_seq_fraction",
    "aborted": "sglang/aborted_seq_fraction",
    "nan_stop": "sglang/nan_stop_seq_fraction",
}


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
        finish_error: ``None``, or why the request did not finish normally (a key of
            :data:`FINISH_ERROR_METRICS`: ``"unfinished"``, ``"aborted"``, ``"nan_stop"``; mask zeroed).
        reasons: human-readable reasons, one per failed check.
        support: the kept ids of every token (:class:`~slime_tis.sglang.support.SamplingSupport`, ``R`` rows),
            parsed with ``sampling_support=True``; ``None`` otherwise.
        support_invalid: rejected for an invalid support row (row emptied, NaN at its log-prob, mask kept).
        rollout_log_mass: ``[R]`` float32 with ``rollout_logprobs="sampling"``: the log of the probability mass the
            sampler kept at each token, ``output_token_logprobs - output_token_sampling_logprobs`` (0 untruncated,
            NaN where either is unusable; ``slime-tis diagnose`` reads it from a dump); ``None`` otherwise.
    """

    token_ids: Tensor
    rollout_log_probs: Tensor
    loss_mask: Tensor
    rejected: bool = False
    misaligned: bool = False
    nonfinite: bool = False
    finish_error: str | None = None
    reasons: list[str] = field(default_factory=list)
    support: SamplingSupport | None = None
    support_invalid: bool = False
    rollout_log_mass: Tensor | None = None

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


class _Unusable:
    """A placeholder value that names why a token has no usable log-prob."""

    def __init__(self, kind: str) -> None:
        self.kind = kind


def _value_errors(values: list[Any], tolerance: float) -> tuple[list[float], list[str]]:
    out: list[float] = []
    bad: dict[str, list[int]] = {}
    for t, v in enumerate(values):
        if isinstance(v, _Unusable):
            bad.setdefault(v.kind, []).append(t)
            out.append(math.nan)
            continue
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


def is_finish_reason(value: Any) -> bool:
    """Whether ``value`` says a request finished: SGLang's ``{"type": "stop" | "length" | "abort", ...}``
    (a non-empty string ``type``), or a non-empty string (``"stop"``, as OpenAI-style servers send).
    ``null`` means running; ``false``, ``0``, ``{}``, ``""`` and other values are not finish reasons."""
    if isinstance(value, Mapping):
        value = value.get("type")
    return isinstance(value, str) and value != ""


def _finish_error(meta: Mapping[str, Any], response: Mapping[str, Any], n: int) -> tuple[str, str] | None:
    """``(kind, reason)`` when ``meta_info.finish_reason`` says the request did not finish normally.

    SGLang's values (``schedule_batch.py``, ``BaseFinishReason.to_json``): ``{"type": "stop",
    "matched": id | str}``, ``{"type": "length", "length": n}``, ``{"type": "abort", "message": str,
    "status_code": int | None, "err_type": str | None}``; ``null`` while the request runs (every
    streamed chunk but the last).
    """
    if "finish_reason" not in meta:
        return None
    fr = meta["finish_reason"]
    if fr is None:
        stream = response.get("stream")
        if isinstance(stream, Mapping) and stream.get("chunks") == 0:
            where = f"no stream chunk of request {response.get('index')!r} of the batch was received"
        elif isinstance(stream, Mapping):
            n_chunks = stream.get("chunks")
            if stream.get("finish_reason_seen", True):
                said = f"finish_reason null in the last of {n_chunks} stream chunk(s)"
            else:
                said = f"no finish_reason in any of {n_chunks} stream chunk(s)"
            where = (
                f"{said}, "
                + ("then [DONE]" if stream.get("done") else "no [DONE] line")
                + ": the stream was cut off before its finishing chunk"
            )
        else:
            where = "finish_reason null: the response is not the request's final output"
        return "unfinished", f"the request had not finished ({where}); its {n} received token(s) are not used"
    if not is_finish_reason(fr):
        return "unfinished", (
            f"finish_reason {fr!r} is not a finish reason (null while the request runs, "
            f"{{'type': 'stop' | 'length' | 'abort', ...}} when it ends); its {n} received token(s) are not used"
        )
    kind = fr.get("type") if isinstance(fr, Mapping) else fr
    if kind == "abort":
        if isinstance(fr, Mapping):
            detail = f"message {fr.get('message')!r}"
            if fr.get("status_code") is not None:
                detail += f", status_code {fr['status_code']}"
            if fr.get("err_type") is not None:
                detail += f", err_type {fr['err_type']!r}"
        else:
            detail = "no message"
        return "aborted", f"SGLang aborted the request (finish_reason abort: {detail})"
    if isinstance(fr, Mapping) and fr.get("matched") == NAN_STOP:
        return "nan_stop", (
            f"SGLang stopped the request with {NAN_STOP!r}: the sampler produced a token id outside the "
            "vocabulary (NaN/inf logits) and the last token was replaced by the stop token"
        )
    return None


def _sampling_logprobs(meta: Mapping[str, Any], ids: list[int]) -> tuple[list[Any], list[str]]:
    """Per-token log-probs of the truncated sampling distribution, from ``output_token_sampling_logprobs``.

    Returns the values (aligned with ``ids``) and alignment errors.
    """
    if "output_token_sampling_logprobs" not in meta:
        raise SGLangLogprobError(
            "rollout_logprobs='sampling' needs meta_info['output_token_sampling_logprobs']: send the /generate "
            "request with \"return_sampling_mask\": true (SGLang >= 0.5.23), or parse with rollout_logprobs='full'"
        )
    vals = meta["output_token_sampling_logprobs"]
    if not isinstance(vals, (list, tuple)):
        raise SGLangLogprobError(
            f"meta_info['output_token_sampling_logprobs'] must be a list, got {type(vals).__name__}"
        )
    n = len(ids)
    if len(vals) != n:
        reason = f"len(output_token_sampling_logprobs) = {len(vals)} but len(output_token_logprobs) = {n}"
        return [0.0] * n, [reason]  # placeholders: a misaligned sequence gets NaN log-probs and mask 0
    support = meta.get("output_token_sampling_mask")
    out: list[Any] = []
    for t, v in enumerate(vals):
        if not isinstance(v, (list, tuple)):  # sampling_logprobs_mode "selected": the sampled token's value
            out.append(v)
            continue
        # sampling_logprobs_mode "support": one value per token id of output_token_sampling_mask[t]
        row = support[t] if isinstance(support, (list, tuple)) and t < len(support) else None
        if not isinstance(row, (list, tuple)) or len(row) != len(v):
            raise SGLangLogprobError(
                f"output_token_sampling_logprobs[{t}] is a list (support mode) but output_token_sampling_mask[{t}] "
                "does not list the same number of token ids"
            )
        out.append(v[list(row).index(ids[t])] if ids[t] in row else _Unusable("sampled-token-outside-support"))
    return out, []


def parse_generate_response(
    response: Mapping[str, Any],
    *,
    on_error: OnError = "reject",
    sampling_params: Mapping[str, Any] | None = None,
    renormalized_logprobs: bool | None = None,
    logprob_tolerance: float = 1e-4,
    rollout_logprobs: RolloutLogprobs = "full",
    sampling_support: bool = False,
    vocab_size: int | None = None,
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
        rollout_logprobs: ``"full"`` (default): pi_rollout = ``output_token_logprobs`` (truncation
            ignored); ``"sampling"``: pi_rollout = ``output_token_sampling_logprobs``, the log-prob under
            the truncated, renormalised distribution the token was drawn from (request sent with
            ``"return_sampling_mask": true``). With ``"sampling"`` the top-p/top-k check does not warn.
        sampling_support: also read each token's sampling support (SGLang's ``output_token_sampling_mask``
            or slime's ``top_p_token_ids`` / ``top_p_token_offsets``; :mod:`slime_tis.sglang.support`) into
            ``RolloutTokens.support``, validated against ``vocab_size`` (required then). A response without a
            support raises :class:`SGLangLogprobError` (the request lacked ``return_sampling_mask``); a bad row
            rejects the sequence (``support_invalid``).
        vocab_size: the model's vocabulary size (ids must lie in ``[0, vocab_size)``).
    """
    if on_error not in ("reject", "raise"):
        raise ValueError(f"on_error must be 'reject' or 'raise', got {on_error!r}")
    if rollout_logprobs not in ("full", "sampling"):
        raise ValueError(f"rollout_logprobs must be 'full' or 'sampling', got {rollout_logprobs!r}")
    if sampling_support and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"sampling_support=True needs vocab_size, an int >= 1, got {vocab_size!r}")
    if not isinstance(response, Mapping):
        raise TypeError(f"response must be a dict (one /generate result), got {type(response).__name__}")
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        raise SGLangLogprobError(
            f"response has no 'meta_info' dict (keys: {sorted(map(str, response))}); "
            "is this an SGLang /generate response?"
        )
    if sampling_params is not None:
        declared = True if rollout_logprobs == "sampling" else renormalized_logprobs
        check_sampling_params(sampling_params, renormalized_logprobs=declared)

    entries = _entries(meta)
    ids = [int(e[1]) for e in entries]
    raw = full_raw = [e[0] for e in entries]
    align_reasons = _alignment_errors(meta, response, ids)
    if rollout_logprobs == "sampling":
        raw, sampling_align = _sampling_logprobs(meta, ids)
        align_reasons += sampling_align
    support, support_bad, support_reasons = None, None, []
    if sampling_support:
        support, support_align = _read_support(meta, len(ids))
        align_reasons += support_align
        if not support_align:
            support, support_bad, support_reasons = validate_support(
                support, torch.tensor(ids, dtype=torch.int64), vocab_size)
    values, value_reasons = _value_errors(raw, logprob_tolerance)
    if support_reasons:  # a token whose support is invalid has no usable log-prob: NaN, the core rejects
        values = [math.nan if bad else v for v, bad in zip(values, support_bad.tolist())]  # host-sync-ok: parsing
    finish = _finish_error(meta, response, len(ids))
    finish_reasons = [finish[1]] if finish else []
    reasons = finish_reasons + align_reasons + value_reasons + support_reasons
    rid = meta.get("id")
    if reasons and on_error == "raise":
        raise SGLangLogprobError(f"request {rid!r}: " + "; ".join(reasons))

    token_ids = torch.tensor(ids, dtype=torch.int64)
    log_probs = torch.tensor(values, dtype=torch.float32)
    mask = torch.ones(len(ids), dtype=torch.float32)
    if align_reasons or finish:
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
        finish_error=finish[0] if finish else None,
        reasons=reasons,
        support=support,
        support_invalid=bool(support_reasons),
        rollout_log_mass=_log_mass(full_raw, log_probs, logprob_tolerance) if rollout_logprobs == "sampling" else None,
    )


def _log_mass(full_raw: list[Any], sampling: Tensor, tolerance: float) -> Tensor:
    """``log p_full(y) - log q(y)`` per token (NaN where either log-prob is unusable)."""
    full, _ = _value_errors(full_raw, tolerance)
    return torch.tensor(full, dtype=torch.float32) - sampling


def _read_support(meta: Mapping[str, Any], n: int) -> tuple[SamplingSupport, list[str]]:
    try:
        support, errors = read_support(meta, n)
    except ValueError as err:
        raise SGLangLogprobError(str(err)) from err
    if support is None:
        raise SGLangLogprobError(
            "sampling_support=True needs the per-token support: send the /generate request with "
            "\"return_sampling_mask\": true (SGLang >= 0.5.23: meta_info['output_token_sampling_mask']) or slime's "
            "custom_params {\"return_top_p_token_ids\": true} (meta_info['top_p_token_ids'] / "
            "['top_p_token_offsets']), or parse with sampling_support=False")
    return support, errors
