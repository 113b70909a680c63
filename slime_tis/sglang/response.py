"""One SGLang ``/generate`` response -> aligned rollout log-probs and token ids (:class:`RolloutTokens`).

Training uses the ids and log-probs of ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` per
generated token), token for token, never re-tokenised text. The checks, what a failure does to the sequence and the
wire fields read: docs/sglang.md, "Checks". A response without ``output_token_logprobs`` (or whose entries are not
``[logprob, token_id, ...]``) is a usage error and always raises :class:`SGLangLogprobError`.
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

__all__ = ["FINISH_ERROR_METRICS", "NAN_STOP", "RolloutTokens", "SGLangLogprobError", "is_finish_reason",
           "parse_generate_response"]

logger = logging.getLogger("slime_tis.sglang")

OnError = Literal["reject", "raise"]
RolloutLogprobs = Literal["full", "sampling"]

#: SGLang's ``finish_reason`` for a NaN/inf sampler output (``schedule_batch.py``, ``FINISH_MATCHED_STR``).
NAN_STOP = "NaN happened"

#: Finish errors -> the metric that counts them (``collate``); one place for the names.
FINISH_ERROR_METRICS = {"unfinished": "sglang/unfinished_seq_fraction", "aborted": "sglang/aborted_seq_fraction",
                        "nan_stop": "sglang/nan_stop_seq_fraction"}


class SGLangLogprobError(ValueError):
    """An SGLang response cannot be turned into aligned rollout log-probs."""


@dataclass
class RolloutTokens:
    """One response (a turn, or a whole trajectory): ``token_ids [R]`` int64, ``rollout_log_probs [R]`` float32 (NaN
    where unusable, 0 at tool tokens), ``loss_mask [R]`` float32 0/1. ``rejected``: a check failed (``reasons``, one
    per check): ``misaligned`` (mask zeroed), ``nonfinite`` (NaN placed, mask kept), ``finish_error`` (a key of
    :data:`FINISH_ERROR_METRICS`, mask zeroed), ``support_invalid`` (row emptied, NaN placed). ``support``: the kept
    ids of each token (``sampling_support=True``); ``rollout_log_mass [R]``: ``output_token_logprobs -
    output_token_sampling_logprobs``, the log of the kept mass (``rollout_logprobs="sampling"``)."""

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
        raise SGLangLogprobError("response meta_info has no 'output_token_logprobs': send the /generate request with "
                                 f"\"return_logprob\": true (keys present: {', '.join(sorted(map(str, meta)))})")
    entries = meta["output_token_logprobs"]
    if not isinstance(entries, (list, tuple)):
        raise SGLangLogprobError("meta_info['output_token_logprobs'] must be a list of [logprob, token_id, text], "
                                 f"got {type(entries).__name__}")
    for t, e in enumerate(entries):
        if not isinstance(e, (list, tuple)) or len(e) < 2:
            raise SGLangLogprobError(f"output_token_logprobs[{t}] must be [logprob, token_id, text_or_null], got {e!r}")
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
            errors.append(f"len(output_token_logprobs) = {n} but len(output_ids) = {len(output_ids)}"
                          + _shift_hint(ids, output_ids))
        elif output_ids != ids:
            first = next(t for t in range(n) if output_ids[t] != ids[t])
            errors.append(f"token ids of output_token_logprobs differ from output_ids at position {first} "
                          f"({ids[first]} vs {output_ids[first]})" + _shift_hint(ids, output_ids))
    return errors


class _Unusable(str):
    """A placeholder log-prob that names why the token has none."""


def _value_errors(values: list[Any], tolerance: float) -> tuple[list[float], list[str]]:
    """The values as floats (NaN where unusable) and one reason per kind of unusable value."""
    out: list[float] = []
    bad: dict[str, list[int]] = {}
    for t, v in enumerate(values):
        if isinstance(v, _Unusable):
            kind = str(v)
        elif v is None:
            kind = "None"
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            kind = "non-numeric"
        elif not math.isfinite(v):
            kind = "NaN" if math.isnan(v) else "infinite"
        else:
            kind = "positive" if v > tolerance else None
        if kind is not None:
            bad.setdefault(kind, []).append(t)
        out.append(math.nan if kind is not None else float(v))
    reasons = []
    for kind, where in bad.items():
        shown = ", ".join(map(str, where[:5])) + (", ..." if len(where) > 5 else "")
        reasons.append(f"{len(where)} {kind} log-prob(s) at generated token(s) {shown}")
    return out, reasons


def is_finish_reason(value: Any) -> bool:
    """Whether ``value`` says a request finished: ``{"type": non-empty str, ...}`` (SGLang) or a non-empty str."""
    if isinstance(value, Mapping):
        value = value.get("type")
    return isinstance(value, str) and value != ""


def _finish_error(meta: Mapping[str, Any], response: Mapping[str, Any], n: int) -> tuple[str, str] | None:
    """``(kind, reason)`` when ``meta_info.finish_reason`` (SGLang's ``BaseFinishReason.to_json``; null while the
    request runs) says the request did not finish normally."""
    if "finish_reason" not in meta:
        return None
    fr = meta["finish_reason"]
    if fr is None:
        stream = response.get("stream")
        if not isinstance(stream, Mapping):
            where = "finish_reason null: the response is not the request's final output"
        elif stream.get("chunks") == 0:
            where = f"no stream chunk of request {response.get('index')!r} of the batch was received"
        else:
            seen = stream.get("finish_reason_seen", True)
            said = "finish_reason null in the last" if seen else "no finish_reason in any"
            done = "then [DONE]" if stream.get("done") else "no [DONE] line"
            where = (f"{said} of {stream.get('chunks')} stream chunk(s), {done}: the stream was cut off before its "
                     "finishing chunk")
        return "unfinished", f"the request had not finished ({where}); its {n} received token(s) are not used"
    if not is_finish_reason(fr):
        return "unfinished", (f"finish_reason {fr!r} is not a finish reason (null while the request runs, "
                              f"{{'type': 'stop' | 'length' | 'abort', ...}} when it ends); its {n} received token(s) "
                              "are not used")
    kind = fr.get("type") if isinstance(fr, Mapping) else fr
    if kind == "abort":
        detail = "no message"
        if isinstance(fr, Mapping):
            extra = [f", {k} {fr[k]!r}" for k in ("status_code", "err_type") if fr.get(k) is not None]
            detail = f"message {fr.get('message')!r}" + "".join(extra)
        return "aborted", f"SGLang aborted the request (finish_reason abort: {detail})"
    if isinstance(fr, Mapping) and fr.get("matched") == NAN_STOP:
        return "nan_stop", (f"SGLang stopped the request with {NAN_STOP!r}: the sampler produced a token id outside "
                            "the vocabulary (NaN/inf logits) and the last token was replaced by the stop token")
    return None


def _sampling_logprobs(meta: Mapping[str, Any], ids: list[int]) -> tuple[list[Any], list[str]]:
    """``output_token_sampling_logprobs`` (one value per token, or per id of ``output_token_sampling_mask[t]`` in
    SGLang's "support" mode) aligned with ``ids``, and alignment errors."""
    if "output_token_sampling_logprobs" not in meta:
        raise SGLangLogprobError(
            "rollout_logprobs='sampling' needs meta_info['output_token_sampling_logprobs']: send the /generate "
            "request with \"return_sampling_mask\": true (SGLang >= 0.5.23), or parse with rollout_logprobs='full'")
    vals = meta["output_token_sampling_logprobs"]
    if not isinstance(vals, (list, tuple)):
        raise SGLangLogprobError("meta_info['output_token_sampling_logprobs'] must be a list, "
                                 f"got {type(vals).__name__}")
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
            raise SGLangLogprobError(f"output_token_sampling_logprobs[{t}] is a list (support mode) but "
                                     f"output_token_sampling_mask[{t}] does not list the same number of token ids")
        out.append(v[list(row).index(ids[t])] if ids[t] in row else _Unusable("sampled-token-outside-support"))
    return out, []


def parse_generate_response(response: Mapping[str, Any], *, on_error: OnError = "reject",
                            sampling_params: Mapping[str, Any] | None = None,
                            renormalized_logprobs: bool | None = None, logprob_tolerance: float = 1e-4,
                            rollout_logprobs: RolloutLogprobs = "full", sampling_support: bool = False,
                            vocab_size: int | None = None) -> RolloutTokens:
    """One ``/generate`` response dict (one request) -> :class:`RolloutTokens` (``loss_mask = 1``), checked as
    docs/sglang.md, "Checks" says: ``on_error="reject"`` marks a failed check's sequence rejected, ``"raise"``
    raises. ``sampling_params`` given: checked by :func:`check_sampling_params` (with ``renormalized_logprobs``).
    ``rollout_logprobs="sampling"``: pi_rollout is ``output_token_sampling_logprobs``. ``sampling_support=True``:
    each token's kept ids, validated against ``vocab_size`` (:mod:`slime_tis.sglang.support`)."""
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
        raise SGLangLogprobError(f"response has no 'meta_info' dict (keys: {sorted(map(str, response))}); "
                                 "is this an SGLang /generate response?")
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
        try:
            support, support_align = read_support(meta, len(ids))
        except ValueError as err:
            raise SGLangLogprobError(str(err)) from err
        align_reasons += support_align
        if not support_align:
            support, support_bad, support_reasons = validate_support(
                support, torch.tensor(ids, dtype=torch.int64), vocab_size)
    values, value_reasons = _value_errors(raw, logprob_tolerance)
    if support_reasons:  # a token whose support is invalid has no usable log-prob: NaN, the core rejects
        values = [math.nan if bad else v for v, bad in zip(values, support_bad.tolist())]  # host-sync-ok: parsing
    finish = _finish_error(meta, response, len(ids))
    reasons = ([finish[1]] if finish else []) + align_reasons + value_reasons + support_reasons
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
    log_mass = None  # log p_full(y) - log q(y): NaN where either log-prob is unusable
    if rollout_logprobs == "sampling":
        log_mass = torch.tensor(_value_errors(full_raw, logprob_tolerance)[0], dtype=torch.float32) - log_probs
    return RolloutTokens(token_ids, log_probs, mask, rejected=bool(reasons), misaligned=bool(align_reasons),
                         nonfinite=bool(value_reasons), finish_error=finish[0] if finish else None, reasons=reasons,
                         support=support, support_invalid=bool(support_reasons), rollout_log_mass=log_mass)

