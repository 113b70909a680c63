"""Line-per-record JSON files (``metrics.jsonl``, log-prob dumps) that a crash may have cut short.

A *torn* final line (no trailing newline, not valid JSON: a write cut short) is dropped and reported by
:func:`read_jsonl`; any other malformed line is a :class:`JSONLError` naming the file and the line.
:func:`torn_tail` tells a writer where the complete part ends, so that it can cut the torn line off before appending.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JSONLError", "JSONLRead", "read_jsonl", "torn_tail"]


class JSONLError(ValueError):
    """A line of a JSONL file is not a JSON value (message: ``FILE:LINE: ...``)."""


@dataclass
class JSONLRead:
    """``rows``: ``(line number, value)`` of every non-blank line; ``torn``: what was dropped, or ``None``."""

    rows: list[tuple[int, Any]] = field(default_factory=list)
    torn: str | None = None


def _decode(raw: bytes) -> Any:
    """One line -> its JSON value; raises ``ValueError`` with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # e.g. an integer literal beyond Python's digit limit
        raise ValueError(f"not valid JSON ({' '.join(str(e).split())[:120]})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None


def _torn_message(path: str | os.PathLike, lineno: int, raw: bytes, why: str) -> str:
    return (f"{os.fspath(path)}:{lineno}: the last line is incomplete ({len(raw)} bytes, no newline, {why}) and was "
            "ignored: a write cut short, e.g. by a crash")


def read_jsonl(path: str | os.PathLike) -> JSONLRead:
    """Every JSON value of ``path`` (one per non-blank line), a torn final line dropped (module docstring)."""
    out = JSONLRead()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            body = raw.strip()
            if not body:
                continue
            try:
                value = _decode(body)
            except ValueError as e:
                if not raw.endswith(b"\n"):  # the final line, never completed
                    out.torn = _torn_message(path, lineno, raw, str(e))
                    break
                raise JSONLError(f"{os.fspath(path)}:{lineno}: {e}") from None
            out.rows.append((lineno, value))
    return out


def torn_tail(path: str | os.PathLike) -> tuple[int, str] | None:
    """``(size to keep, description)`` when the last line of ``path`` lacks its newline: the file size when that
    line is valid JSON (the caller completes it), else where the line starts; ``None`` when the file ends with a
    newline or is empty. One pass over the file in 1 MiB blocks."""
    start, lineno, size = 0, 1, 0  # where the last line starts, its number, bytes read
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            if (nl := block.rfind(b"\n")) >= 0:
                start, lineno = size + nl + 1, lineno + block.count(b"\n")
            size += len(block)
        if start == size:  # empty, or ends with a newline
            return None
        f.seek(start)
        raw = f.read()
    if not raw.strip():
        return start, f"{os.fspath(path)}:{lineno}: trailing blank bytes without a newline"
    try:
        _decode(raw.strip())
    except ValueError as e:
        return start, _torn_message(path, lineno, raw, str(e))
    return size, f"{os.fspath(path)}:{lineno}: the last line lacks its newline"
