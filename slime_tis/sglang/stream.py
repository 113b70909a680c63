"""SGLang streaming ``/generate`` output (``data: {json}`` lines, ``data: [DONE]``) -> non-streaming response dicts.

Cumulative and incremental chunks, batched streams, SGLang's abort of a queued request, and when a request counts
as unfinished: docs/sglang.md, "Streams". A merged dict is a non-streaming response plus ``"index"`` and
``"stream": {"chunks", "done", "ahead", "finish_reason_seen"[, "abort_note"]}``. Linear time in the bytes received.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .response import SGLangLogprobError, is_finish_reason

__all__ = ["TOKEN_LISTS", "merge_stream_batch", "merge_stream_chunks"]

#: ``meta_info`` lists with one entry per output token: the ones SGLang slices in incremental mode
#: (``_INCREMENTAL_STREAMING_META_INFO_KEYS`` in ``tokenizer_manager.py``, 0.5.23). Merged alike.
TOKEN_LISTS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
    "output_token_sampling_mask",
    "output_token_sampling_logprobs",
)
_PRIMARY = "output_token_logprobs"


class _Lines:
    """Iterate the chunk dicts of a stream; ``done`` tells whether ``data: [DONE]`` was seen."""

    def __init__(self, lines: Iterable[str | bytes | Mapping[str, Any]]) -> None:
        self.lines = lines
        self.done = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for lineno, line in enumerate(self.lines):
            if isinstance(line, Mapping):
                yield dict(line)
                continue
            if isinstance(line, bytes):
                line = line.decode("utf-8")
            if not isinstance(line, str):
                raise TypeError(f"stream line {lineno} must be str, bytes or dict, got {type(line).__name__}")
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            if not line.startswith("data:"):
                raise SGLangLogprobError(f"stream line {lineno} is not a server-sent 'data:' line: {line[:80]!r}")
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                self.done = True
                return
            try:
                obj = json.loads(payload)
            except json.JSONDecodeError as e:
                msg = f"stream line {lineno}: invalid JSON ({e.msg}): {payload[:80]!r}"
                raise SGLangLogprobError(msg) from None
            if not isinstance(obj, dict):
                raise SGLangLogprobError(f"stream line {lineno}: expected a JSON object, got {type(obj).__name__}")
            if "error" in obj and "meta_info" not in obj:
                raise SGLangLogprobError(f"stream line {lineno}: server error {obj['error']!r}")
            yield obj


def _same(a: Any, b: Any) -> bool:
    """Equality of JSON values where NaN equals NaN (a log-prob may be NaN)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _extends(new: list[Any], old: list[Any]) -> bool:
    """``new`` starts with every entry of ``old`` (NaN equals NaN). Linear in ``len(old)``, which a
    cumulative chunk repeats anyway; list equality runs in C, the NaN-aware walk only on a mismatch."""
    head = new[:len(old)]
    return len(head) == len(old) and (head == old or _same(head, old))


def _length_field(meta: Mapping[str, Any]) -> int | None:
    value = meta.get("output_token_logprobs_length")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Accumulator:
    """The merged state of one request (one ``index``) of a stream."""

    def __init__(self, incremental: bool | None, index: int) -> None:
        self.forced = incremental
        self.mode: bool | None = incremental
        self.index = index
        self.lists: dict[str, list[Any]] = {}
        self.output_ids: list[int] | None = None
        self.text_parts: list[str] = []
        self.last_text: str | None = None
        self.meta: dict[str, Any] = {}
        self.n_chunks = 0
        self.ahead = 0
        self.finished = False
        self.saw_finish_key = False
        self.abort_note: str | None = None

    @property
    def entries(self) -> list[Any]:
        return self.lists.get(_PRIMARY, [])

    def _where(self) -> str:
        return f"stream chunk {self.n_chunks}" + (f" of index {self.index}" if self.index else "")

    def _is_incremental(self, lps: list[Any], total: int | None) -> bool:
        """As forced; else by the length field ``total``; else inferred once (a first chunk reads either way)."""
        if self.forced is None and total is not None:
            return len(lps) < total
        if self.mode is None and self.entries:
            self.mode = not _extends(lps, self.entries)
        return bool(self.mode)

    def add(self, chunk: Mapping[str, Any]) -> None:
        meta = chunk.get("meta_info")
        if not isinstance(meta, Mapping):
            raise SGLangLogprobError(f"{self._where()} has no 'meta_info' dict")
        if self.finished:
            raise SGLangLogprobError(f"{self._where()} arrives after the request's finishing chunk")
        if not isinstance(meta.get(_PRIMARY), (list, tuple)):
            raise SGLangLogprobError(f"{self._where()} has no meta_info['output_token_logprobs']: "
                                     "send the request with \"return_logprob\": true")
        lists = {k: list(meta[k]) for k in TOKEN_LISTS if isinstance(meta.get(k), (list, tuple))}
        ids = list(chunk["output_ids"]) if isinstance(chunk.get("output_ids"), (list, tuple)) else None
        text = chunk.get("text") if isinstance(chunk.get("text"), str) else None
        fr, total = meta.get("finish_reason"), _length_field(meta)
        finishing = is_finish_reason(fr)
        if finishing and self._is_state_dump(lists, ids, total):  # it replaces what was received
            self.lists.update(lists)
            self.output_ids = [e[1] for e in lists[_PRIMARY]]
            if text is not None:
                self.text_parts, self.last_text = [], text
        elif fr == "abort" or isinstance(fr, Mapping) and fr.get("type") == "abort":
            try:
                self._merge(lists, ids, text, total)
            except SGLangLogprobError as e:
                # the request ends aborted (rejected and counted as such whatever its tokens); a chunk whose
                # token lists do not fit what was received does not take the other requests down with it
                self.abort_note = str(e)
        else:
            self._merge(lists, ids, text, total)
        self.saw_finish_key = self.saw_finish_key or "finish_reason" in meta
        self.meta = dict(meta)
        self.n_chunks += 1
        self.finished = finishing

    def _is_state_dump(self, lists: dict[str, list[Any]], ids: list[Any] | None, total: int | None) -> bool:
        """A finishing chunk of the request's whole state, as SGLang's abort of a queued request sends it in both
        modes (``TokenizerManager._handle_abort_req``): full per-token lists (the length field counts them all),
        full text, ``output_ids`` holding only the last id (``[]`` without tokens)."""
        lps = lists[_PRIMARY]
        return (total is not None and len(lps) == total and ids is not None and len(ids) <= 1
                and all(isinstance(e, (list, tuple)) and len(e) >= 2 for e in lps)
                and ids == [e[1] for e in lps[-1:]]
                and all(_extends(values, self.lists.get(key, [])) for key, values in lists.items()))

    def _merge(self, lists: dict[str, list[Any]], ids: list[Any] | None, text: str | None, total: int | None) -> None:
        """Merge one chunk's tokens (an incremental delta, or a cumulative chunk extending what was received)."""
        lps = lists[_PRIMARY]
        if self._is_incremental(lps, total):
            if total is not None and len(self.entries) + len(lps) != total:
                raise SGLangLogprobError(
                    f"{self._where()}: {len(lps)} log-prob entries with {len(self.entries)} "
                    f"received so far do not add up to output_token_logprobs_length = {total}")
            for key, values in lists.items():
                self.lists.setdefault(key, []).extend(values)
            if ids is not None:
                self.output_ids = self.output_ids or []
                self.output_ids.extend(ids)  # in place: a long stream of deltas merges in linear time
            if text is not None:
                self.text_parts.append(text)
            return
        for key, values in lists.items():
            old = self.lists.get(key, [])
            if not _extends(values, old):
                raise SGLangLogprobError(
                    f"{self._where()} is cumulative but its {key} does not extend the {len(old)} entries "
                    "received so far (chunks out of order, or mixed streaming modes?)")
            self.lists[key] = values
        if total is not None and len(lps) > total:
            self.ahead += 1  # serialised after its (referenced) lists grew: later tokens, already here
        if ids is not None:
            if self.output_ids is not None and not _extends(ids, self.output_ids):
                raise SGLangLogprobError(
                    f"{self._where()} is cumulative but its output_ids do not extend the "
                    f"{len(self.output_ids)} ids received so far (an earlier token was rewritten)")
            self.output_ids = ids
        if text is not None:
            self.last_text = text

    def result(self, done: bool) -> dict[str, Any]:
        """The merged response; a request without a finishing chunk (or without any chunk) gets ``finish_reason``
        null, unless no chunk carried the key and ``[DONE]`` closed the stream."""
        meta = {**self.meta, **self.lists, _PRIMARY: self.entries, "output_token_logprobs_length": len(self.entries)}
        if not self.finished and (self.saw_finish_key or not done or self.n_chunks == 0):
            meta["finish_reason"] = None
        if "output_token_sampling_mask" in self.lists:
            meta["output_token_sampling_mask_length"] = len(self.lists["output_token_sampling_mask"])
        stream = {"chunks": self.n_chunks, "done": done, "ahead": self.ahead,
                  "finish_reason_seen": self.saw_finish_key}
        if self.abort_note is not None:
            stream["abort_note"] = self.abort_note
        text = "".join(self.text_parts) if self.text_parts else self.last_text
        ids = {} if self.output_ids is None else {"output_ids": self.output_ids}  # none: not checked by the parser
        return {"text": text, "meta_info": meta, **ids, "stream": stream, "index": self.index}


def _merge(chunks: Iterable[str | bytes | Mapping[str, Any]], incremental: bool | None, num_requests: int | None,
           batch: bool) -> list[dict[str, Any]]:
    """Every chunk merged into the request of its ``index`` (0 without one); one result per request."""
    lines = _Lines(chunks)
    accs: dict[int, _Accumulator] = {}
    for chunk in lines:
        index = chunk.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise SGLangLogprobError(f"stream chunk has a non-integer 'index' {index!r}")
        if "index" in chunk and not batch and index != 0:
            raise SGLangLogprobError(f"stream chunk has 'index' {index}: the stream holds several requests; use "
                                     "merge_stream_batch with num_requests")
        if "index" in chunk and batch and num_requests is None:
            raise SGLangLogprobError(
                f"stream chunk has 'index' {index}: a batched stream needs num_requests (len(input_ids) x n), "
                "so that a request that sends no chunk is returned, rejected and counted instead of lost")
        if num_requests is not None and not 0 <= index < num_requests:
            raise SGLangLogprobError(f"stream chunk has 'index' {index}, expected [0, {num_requests})")
        if index not in accs:
            accs[index] = _Accumulator(incremental, index)
        accs[index].add(chunk)
    if num_requests is None:
        if not accs:
            raise SGLangLogprobError("empty stream: no chunk with meta_info was received")
        return [accs[0].result(lines.done)]
    return [accs.get(i, _Accumulator(incremental, i)).result(lines.done) for i in range(num_requests)]


def merge_stream_batch(
    chunks: Iterable[str | bytes | Mapping[str, Any]],
    *,
    incremental: bool | None = None,
    num_requests: int | None = None,
) -> list[dict[str, Any]]:
    """The chunks of a streaming request -> one response dict per request, result ``i`` = request ``i``;
    ``num_requests`` (``len(input_ids)`` x ``n``) is required when the chunks carry ``index``: a request that sent no
    chunk is an empty, unfinished result in its place (docs/sglang.md, "Streams")."""
    if num_requests is not None and (
        isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1
    ):
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    return _merge(chunks, incremental, num_requests, batch=True)


def merge_stream_chunks(
    chunks: Iterable[str | bytes | Mapping[str, Any]], *, incremental: bool | None = None
) -> dict[str, Any]:
    """The chunks of one streaming request -> one non-streaming-shaped response dict (several requests: use
    :func:`merge_stream_batch`)."""
    return _merge(chunks, incremental, None, batch=False)[0]
