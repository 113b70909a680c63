"""Reassemble SGLang streaming ``/generate`` output (``"stream": true``) into one response dict.

The stream is server-sent events: lines ``data: {json}`` and a final ``data: [DONE]``. Each JSON
chunk has ``text``, ``output_ids`` and ``meta_info`` (with ``output_token_logprobs`` when
``return_logprob`` is set, ``finish_reason`` ``null`` on every chunk but the request's last).
SGLang has two streaming modes:

* default (cumulative): every chunk carries *all* tokens so far in ``output_token_logprobs``;
* ``--incremental-streaming-output``: every chunk carries only the *new* tokens (``output_ids``,
  ``output_token_logprobs`` and the other per-token lists are sliced to the delta).

Both carry ``meta_info.output_token_logprobs_length``, the total *when the chunk was built*. A
cumulative chunk holds at least that many entries: SGLang's intermediate chunks reference the
request's growing lists instead of copying them (``tokenizer_manager.py``, "pass reference (no
copy)"), so a chunk serialised late -- typical of batched and ``n > 1`` streams, whose chunks wait
for their turn -- already holds later tokens. An incremental chunk holds fewer (the delta) after the
first. Hence: ``len(list) < length`` means incremental (and the deltas must add up to the length);
otherwise the chunk is cumulative and must extend what was received, entry for entry (a chunk that
rewrites an earlier token is an error; the length field is only a cross-check; a chunk ahead of it is
counted in ``stream["ahead"]``). Without the field (other
servers, hand-built chunks) the mode is inferred: a chunk whose list starts with everything received
so far is cumulative. Pass ``incremental=True/False`` to force it. A batched streaming request tags
chunks with ``"index"``; :func:`merge_stream_batch` splits them (give it ``num_requests``: a request
that sent no chunk is then returned empty, rejected and counted, in its own place). Merging costs time
linear in the bytes received.

The merged dict has the shape of a non-streaming response plus ``"index"`` and ``"stream": {"chunks",
"done", "ahead"}`` (chunks merged, whether ``[DONE]`` was seen, chunks whose lists were ahead of their
length field). Only a non-empty ``finish_reason`` (SGLang's ``{"type": ...}`` or a string) ends a
request; ``false``, ``0``, ``{}`` or ``""`` do not. It goes to
:func:`slime_tis.sglang.parse_generate_response`, which performs the alignment checks and rejects,
with the reason, a request whose last chunk is not its finishing one (``finish_reason`` null: a
stream cut off early).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .response import SGLangLogprobError, is_finish_reason

__all__ = ["TOKEN_LISTS", "iter_stream_chunks", "merge_stream_batch", "merge_stream_chunks"]

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
#: Without ``num_requests``, requests missing below the highest index are filled in: up to this index.
MAX_UNDECLARED_INDEX = 1 << 16


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


def iter_stream_chunks(lines: Iterable[str | bytes | Mapping[str, Any]]) -> Iterable[dict[str, Any]]:
    """Yield chunk dicts from raw SSE lines (``str``/``bytes``) or already-decoded dicts.

    Blank lines and SSE comments are skipped; ``data: [DONE]`` ends the stream.
    """
    return iter(_Lines(lines))


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
    n = len(old)
    if len(new) < n:
        return False
    head = new[:n] if len(new) > n else new
    return head == old or _same(head, old)


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

    @property
    def entries(self) -> list[Any]:
        return self.lists.get(_PRIMARY, [])

    def _where(self) -> str:
        return f"stream chunk {self.n_chunks}" + (f" of index {self.index}" if self.index else "")

    def _is_incremental(self, lps: list[Any], meta: Mapping[str, Any]) -> bool:
        if self.forced is not None:
            return self.forced
        total = _length_field(meta)
        if total is not None:
            return len(lps) < total
        if self.mode is not None:
            return self.mode
        n = len(self.entries)
        if n == 0:
            return False  # first chunk: both readings agree
        self.mode = not _extends(lps, self.entries)
        return self.mode

    def add(self, chunk: Mapping[str, Any]) -> None:
        meta = chunk.get("meta_info")
        if not isinstance(meta, Mapping):
            raise SGLangLogprobError(f"{self._where()} has no 'meta_info' dict")
        if self.finished:
            raise SGLangLogprobError(f"{self._where()} arrives after the request's finishing chunk")
        lps = meta.get(_PRIMARY)
        if lps is None:
            raise SGLangLogprobError(
                f"{self._where()} has no meta_info['output_token_logprobs']: "
                "send the request with \"return_logprob\": true"
            )
        lps = list(lps)
        total = _length_field(meta)
        lists = {k: list(meta[k]) for k in TOKEN_LISTS if isinstance(meta.get(k), (list, tuple))}
        ids = chunk.get("output_ids")
        if self._is_incremental(lps, meta):
            if total is not None and len(self.entries) + len(lps) != total:
                raise SGLangLogprobError(
                    f"{self._where()}: {len(lps)} log-prob entries with {len(self.entries)} "
                    f"received so far do not add up to output_token_logprobs_length = {total}"
                )
            for key, values in lists.items():
                self.lists.setdefault(key, []).extend(values)
            if isinstance(ids, (list, tuple)):
                if self.output_ids is None:
                    self.output_ids = []
                self.output_ids.extend(ids)  # in place: a long stream of deltas merges in linear time
            if isinstance(chunk.get("text"), str):
                self.text_parts.append(chunk["text"])
        else:
            for key, values in lists.items():
                old = self.lists.get(key, [])
                if not _extends(values, old):
                    raise SGLangLogprobError(
                        f"{self._where()} is cumulative but its {key} does not extend the {len(old)} entries "
                        "received so far (chunks out of order, or mixed streaming modes?)"
                    )
                self.lists[key] = values
            if total is not None and len(lps) > total:
                self.ahead += 1  # serialised after its (referenced) lists grew: later tokens, already here
            if isinstance(ids, (list, tuple)):
                ids = list(ids)
                if self.output_ids is not None and not _extends(ids, self.output_ids):
                    raise SGLangLogprobError(
                        f"{self._where()} is cumulative but its output_ids do not extend the "
                        f"{len(self.output_ids)} ids received so far (an earlier token was rewritten)"
                    )
                self.output_ids = ids
            if isinstance(chunk.get("text"), str):
                self.last_text = chunk["text"]
        self.meta = dict(meta)
        self.n_chunks += 1
        self.finished = is_finish_reason(meta.get("finish_reason"))

    def result(self, done: bool) -> dict[str, Any]:
        if self.n_chunks == 0:
            raise SGLangLogprobError("empty stream: no chunk with meta_info was received")
        meta = dict(self.meta)
        meta.update(self.lists)
        meta["output_token_logprobs_length"] = len(self.entries)
        if "output_token_sampling_mask" in self.lists:
            meta["output_token_sampling_mask_length"] = len(self.lists["output_token_sampling_mask"])
        text = "".join(self.text_parts) if self.text_parts else self.last_text
        out: dict[str, Any] = {"text": text, "meta_info": meta}
        if self.output_ids is not None:
            out["output_ids"] = self.output_ids
        out["stream"] = {"chunks": self.n_chunks, "done": done, "ahead": self.ahead}
        out["index"] = self.index
        return out


def _missing(index: int, done: bool) -> dict[str, Any]:
    """The result of a request of the batch that sent no chunk: no tokens, ``finish_reason`` null, so
    :func:`slime_tis.sglang.parse_generate_response` rejects it as unfinished (and ``collate`` counts it)."""
    meta = {"output_token_logprobs": [], "output_token_logprobs_length": 0, "finish_reason": None}
    return {
        "text": None,
        "output_ids": [],
        "meta_info": meta,
        "stream": {"chunks": 0, "done": done, "ahead": 0},
        "index": index,
    }


def merge_stream_batch(
    chunks: Iterable[str | bytes | Mapping[str, Any]],
    *,
    incremental: bool | None = None,
    num_requests: int | None = None,
) -> list[dict[str, Any]]:
    """Merge the chunks of a (possibly batched) streaming request; one response dict per request,
    ordered by ``index`` and carrying it (``result["index"]``; chunks without ``index`` belong to 0).

    ``num_requests``: how many requests the batch holds (``len(input_ids)`` of a batched request,
    times ``n`` for parallel sampling). Result ``i`` is always request ``i``: a request that sent no
    chunk at all -- beyond the highest index seen only when ``num_requests`` is given, so pass it --
    gets an empty result with ``finish_reason`` null and ``stream["chunks"] = 0``, which
    :func:`slime_tis.sglang.parse_generate_response` rejects as unfinished and ``collate`` counts in
    ``sglang/unfinished_seq_fraction``; the next request's tokens never take its place. A chunk with an
    index outside ``[0, num_requests)`` is an error.

    A request whose stream stops before its finishing chunk is still returned (``finish_reason``
    null, ``stream["done"]`` false when ``[DONE]`` is missing) and is rejected, counted, by
    :func:`slime_tis.sglang.parse_generate_response`; the other requests of the batch are unaffected.
    """
    if num_requests is not None and (
        isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1
    ):
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    lines = _Lines(chunks)
    accs: dict[int, _Accumulator] = {}
    for chunk in lines:
        index = chunk.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise SGLangLogprobError(f"stream chunk has a non-integer 'index' {index!r}")
        if index < 0 or (num_requests is not None and index >= num_requests):
            expected = f"[0, {num_requests})" if num_requests is not None else ">= 0"
            raise SGLangLogprobError(f"stream chunk has 'index' {index}, expected {expected}")
        if index not in accs:
            accs[index] = _Accumulator(incremental, index)
        accs[index].add(chunk)
    if not accs and num_requests is None:
        raise SGLangLogprobError("empty stream: no chunk with meta_info was received")
    if num_requests is None and max(accs) >= MAX_UNDECLARED_INDEX:
        raise SGLangLogprobError(
            f"stream chunk has 'index' {max(accs)} (>= {MAX_UNDECLARED_INDEX}): pass num_requests to merge "
            "a batch that large"
        )
    n = num_requests if num_requests is not None else max(accs) + 1
    return [accs[i].result(lines.done) if i in accs else _missing(i, lines.done) for i in range(n)]


def merge_stream_chunks(
    chunks: Iterable[str | bytes | Mapping[str, Any]], *, incremental: bool | None = None
) -> dict[str, Any]:
    """Merge the chunks of one streaming request into one non-streaming-shaped response dict.

    Raises :class:`SGLangLogprobError` if the chunks belong to several requests (use
    :func:`merge_stream_batch`), are inconsistent, or carry no log-probs.
    """
    merged = merge_stream_batch(chunks, incremental=incremental)
    if len(merged) != 1:
        raise SGLangLogprobError(
            f"stream has chunks of {len(merged)} requests (several 'index' values); use merge_stream_batch"
        )
    return merged[0]
