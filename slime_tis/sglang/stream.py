"""Reassemble SGLang streaming ``/generate`` output (``"stream": true``) into one response dict.

The stream is server-sent events: lines ``data: {json}`` and a final ``data: [DONE]``. Each JSON
chunk has ``text``, ``output_ids`` and ``meta_info`` (with ``output_token_logprobs`` when
``return_logprob`` is set). SGLang has two streaming modes:

* default (cumulative): every chunk carries *all* tokens so far in ``output_token_logprobs``;
* ``--incremental-streaming-output``: every chunk carries only the *new* tokens (``output_ids``,
  ``output_token_logprobs`` are sliced to the delta).

Both carry ``meta_info.output_token_logprobs_length``, the total so far, which identifies the mode
exactly. Without it (other servers, hand-built chunks) the mode is inferred: a chunk whose list
starts with everything received so far is cumulative. Pass ``incremental=True/False`` to force it.
A batched streaming request tags chunks with ``"index"``; :func:`merge_stream_batch` splits them.

The merged dict has the shape of a non-streaming response and goes to
:func:`slime_tis.sglang.parse_generate_response`, which performs the alignment checks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .response import SGLangLogprobError

__all__ = ["iter_stream_chunks", "merge_stream_batch", "merge_stream_chunks"]


def iter_stream_chunks(lines: Iterable[str | bytes | Mapping[str, Any]]) -> Iterable[dict[str, Any]]:
    """Yield chunk dicts from raw SSE lines (``str``/``bytes``) or already-decoded dicts.

    Blank lines and SSE comments are skipped; ``data: [DONE]`` ends the stream.
    """
    for lineno, line in enumerate(lines):
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
            return
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError as e:
            msg = f"stream line {lineno}: invalid JSON ({e.msg}): {payload[:80]!r}"
            raise SGLangLogprobError(msg) from None
        if not isinstance(obj, dict):
            raise SGLangLogprobError(
                f"stream line {lineno}: expected a JSON object, got {type(obj).__name__}"
            )
        if "error" in obj and "meta_info" not in obj:
            raise SGLangLogprobError(f"stream line {lineno}: server error {obj['error']!r}")
        yield obj


class _Accumulator:
    def __init__(self, incremental: bool | None) -> None:
        self.forced = incremental
        self.mode: bool | None = incremental
        self.entries: list[Any] = []
        self.output_ids: list[int] | None = None
        self.text_parts: list[str] = []
        self.last_text: str | None = None
        self.meta: dict[str, Any] = {}
        self.n_chunks = 0

    def _is_incremental(self, lps: list[Any], meta: Mapping[str, Any]) -> bool:
        if self.forced is not None:
            return self.forced
        total = meta.get("output_token_logprobs_length")
        if isinstance(total, int) and not isinstance(total, bool):
            if len(lps) == total and len(self.entries) + len(lps) != total:
                return False
            if len(self.entries) + len(lps) == total and len(lps) != total:
                return True
            if len(lps) == total:  # both readings agree (first chunk, or empty history)
                return False
            raise SGLangLogprobError(
                f"stream chunk {self.n_chunks}: {len(lps)} log-prob entries with {len(self.entries)} "
                f"received so far do not add up to output_token_logprobs_length = {total}"
            )
        if self.mode is not None:
            return self.mode
        n = len(self.entries)
        if n and len(lps) >= n and [list(e) for e in lps[:n]] == [list(e) for e in self.entries]:
            self.mode = False
            return False
        if n:
            self.mode = True
        return n > 0

    def add(self, chunk: Mapping[str, Any]) -> None:
        meta = chunk.get("meta_info")
        if not isinstance(meta, Mapping):
            raise SGLangLogprobError(f"stream chunk {self.n_chunks} has no 'meta_info' dict")
        lps = meta.get("output_token_logprobs")
        if lps is None:
            raise SGLangLogprobError(
                f"stream chunk {self.n_chunks} has no meta_info['output_token_logprobs']: "
                "send the request with \"return_logprob\": true"
            )
        lps = list(lps)
        incremental = self._is_incremental(lps, meta)
        ids = chunk.get("output_ids")
        if incremental:
            self.entries.extend(lps)
            if isinstance(ids, (list, tuple)):
                self.output_ids = (self.output_ids or []) + list(ids)
            if isinstance(chunk.get("text"), str):
                self.text_parts.append(chunk["text"])
        else:
            n = len(self.entries)
            if len(lps) < n or [list(e) for e in lps[:n]] != [list(e) for e in self.entries]:
                raise SGLangLogprobError(
                    f"stream chunk {self.n_chunks} is cumulative but does not extend the {n} entries "
                    "received so far (chunks out of order, or mixed streaming modes?)"
                )
            self.entries = lps
            if isinstance(ids, (list, tuple)):
                self.output_ids = list(ids)
            if isinstance(chunk.get("text"), str):
                self.last_text = chunk["text"]
        self.meta = dict(meta)
        self.n_chunks += 1

    def result(self) -> dict[str, Any]:
        if self.n_chunks == 0:
            raise SGLangLogprobError("empty stream: no chunk with meta_info was received")
        meta = dict(self.meta)
        meta["output_token_logprobs"] = self.entries
        meta["output_token_logprobs_length"] = len(self.entries)
        text = "".join(self.text_parts) if self.text_parts else self.last_text
        out: dict[str, Any] = {"text": text, "meta_info": meta}
        if self.output_ids is not None:
            out["output_ids"] = self.output_ids
        return out


def merge_stream_batch(
    chunks: Iterable[str | bytes | Mapping[str, Any]], *, incremental: bool | None = None
) -> list[dict[str, Any]]:
    """Merge the chunks of a (possibly batched) streaming request; one response dict per ``index``,
    ordered by index (chunks without ``index`` belong to index 0)."""
    accs: dict[int, _Accumulator] = {}
    for chunk in iter_stream_chunks(chunks):
        index = chunk.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise SGLangLogprobError(f"stream chunk has a non-integer 'index' {index!r}")
        accs.setdefault(index, _Accumulator(incremental)).add(chunk)
    if not accs:
        raise SGLangLogprobError("empty stream: no chunk with meta_info was received")
    return [accs[i].result() for i in sorted(accs)]


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
