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
        lineno = 0
        for raw in f:
            lineno += 1
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
    newline or is empty. Reads only the last line."""
    size = os.path.getsize(path)
    if size == 0:
        return None
    with open(path, "rb") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return None
        start, block = size, 1 << 16
        while start > 0:  # find the start of the last line, reading backwards in blocks
            lo = max(0, start - block)
            f.seek(lo)
            chunk = f.read(start - lo)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                start = lo + nl + 1
                break
            start = lo
        f.seek(start)
        raw = f.read(size - start)
        f.seek(0)
        lineno = 1
        while f.tell() < start:  # the last line's number
            lineno += f.read(min(1 << 20, start - f.tell())).count(b"\n")
    if not raw.strip():
        return start, f"{os.fspath(path)}:{lineno}: trailing blank bytes without a newline"
    try:
        _decode(raw.strip())
    except ValueError as e:
        return start, _torn_message(path, lineno, raw, str(e))
    return size, f"{os.fspath(path)}:{lineno}: the last line lacks its newline"

