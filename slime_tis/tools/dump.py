"""Log-prob dumps on disk (``.jsonl`` or ``.pt``): per response token, the rollout and the training log-prob.

The format is docs/dump_format.md (the one place for it). ``slime-tis diagnose`` reads dumps, and slime's own
``--save-debug-train-data`` files (:mod:`slime_tis.tools.slime_dump`); the example job and the slime hooks write
them. Malformed input is a :class:`DumpFormatError` naming the file, the line or record, and the field.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slime_tis.tools.jsonl import JSONLError, read_jsonl
from slime_tis.tools.slime_dump import is_slime_dump, slime_records

__all__ = ["DumpFormatError", "FIELDS", "FORMAT_NAME", "FORMAT_VERSION", "LogprobDump", "read_logprob_dump",
           "records_from_packed", "records_from_samples", "write_logprob_dump", "dump_files"]


class DumpFormatError(ValueError):
    """A dump (or one of its records) is malformed; the message names the file, record and field."""


FORMAT_NAME = "slime_tis.logprob_dump"
FORMAT_VERSION = 1

#: every field of a dump: (one value per "token" or per "seq"uence, kind "float", "int" or "mask" (0 / 1))
FIELDS = {
    "train_log_probs": ("token", "float"),
    "rollout_log_probs": ("token", "float"),
    "loss_mask": ("token", "mask"),
    "step": ("seq", "int"),
    "sample_index": ("seq", "int"),
    "token_ids": ("token", "int"),
    "reward": ("seq", "float"),
    "rollout_log_mass": ("token", "float"),
    "routing_differs": ("token", "mask"),
    "staleness": ("seq", "float"),
}
_REQUIRED = ("train_log_probs", "rollout_log_probs")
#: the value of these fields where a record has none; the other absent fields are None (per token) or NaN
_DEFAULT = {"loss_mask": 1, "step": -1, "sample_index": -1}
_ALWAYS = (*_REQUIRED, *_DEFAULT)
_DTYPE = {"float": torch.float32, "int": torch.int64, "mask": torch.bool}
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_MAX_OBJECTS = 50_000_000


@dataclass
class LogprobDump:
    """A dump in the packed layout: ``n`` sequences of ``T`` tokens in all, each field of :data:`FIELDS` a ``[T]``
    or ``[n]`` tensor (float32, int64 or bool) as in docs/dump_format.md's ``.pt`` table, ``None`` where the dump
    has none. ``meta``: the header fields; ``notes``: what the reader tolerated (a torn last line), one sentence
    each."""

    train_log_probs: Tensor
    rollout_log_probs: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor
    step: Tensor
    sample_index: Tensor
    token_ids: Tensor | None = None
    reward: Tensor | None = None
    rollout_log_mass: Tensor | None = None
    routing_differs: Tensor | None = None
    staleness: Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def n_seq(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def lengths(self) -> Tensor:
        """``[n]`` int64 response lengths (all tokens, masked or not)."""
        return self.cu_seqlens.diff()

    @property
    def valid_lengths(self) -> Tensor:
        """``[n]`` int64 number of tokens with ``loss_mask = 1`` per sequence."""
        return _cu(self.loss_mask)[self.cu_seqlens].diff()

    def select(self, seq_keep: Tensor) -> LogprobDump:
        """The sub-dump of the sequences where ``seq_keep [n]`` (bool) is true."""
        seq_keep = seq_keep.to(torch.bool)
        keep = {"token": torch.repeat_interleave(seq_keep, self.lengths), "seq": seq_keep}
        cols = {key: None if (v := getattr(self, key)) is None else v[keep[per]] for key, (per, _) in FIELDS.items()}
        return LogprobDump(**cols, cu_seqlens=_cu(self.lengths[seq_keep]), meta=dict(self.meta),
                           notes=list(self.notes))


def _cu(lengths: Tensor) -> Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.to(torch.int64), 0)])


def records_from_packed(train_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, cu_seqlens: Tensor,
                        **fields: Any) -> list[dict[str, Any]]:
    """Packed ``[T]`` tensors (core layout, ``cu_seqlens [n + 1]``) -> per-sequence records for
    :func:`write_logprob_dump`. ``fields``: others of :data:`FIELDS` (``step=``, ``token_ids=``...), a ``[T]`` tensor
    per token, one number, a list or a tensor per sequence (a NaN value is left out). Copies to the CPU."""
    if set(fields) - set(FIELDS):
        raise TypeError(f"records_from_packed: unknown field(s) {sorted(set(fields) - set(FIELDS))}")
    given = {"train_log_probs": train_log_probs, "rollout_log_probs": rollout_log_probs, "loss_mask": loss_mask,
             **fields}
    cu = cu_seqlens.detach().to("cpu", torch.int64).tolist()  # host-sync-ok (writing a dump)
    n = len(cu) - 1
    cols: dict[str, list] = {}
    for key, value in given.items():
        per, kind = FIELDS[key]
        if value is None:
            continue
        if per == "seq":
            cols[key] = _per_seq(value, n, key)
            continue
        x = value.detach().cpu()  # host-sync-ok (writing a dump)
        x = x.float() if kind == "float" else (x != 0).to(torch.int64) if kind == "mask" else x
        cols[key] = [x[a:b].tolist() for a, b in zip(cu[:-1], cu[1:])]  # host-sync-ok (writing a dump)
    return [{k: col[i] for k, col in cols.items() if not (isinstance(col[i], float) and math.isnan(col[i]))}
            for i in range(n)]


def records_from_samples(train_log_probs: Sequence[Tensor], rollout_log_probs: Sequence[Tensor],
                         loss_masks: Sequence[Tensor] | None = None, *, step: int | Sequence[int] | None = None,
                         sample_index: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Per-sample ``[R_i]`` tensors or lists (slime's layout, CP chunks gathered) -> records for
    :func:`write_logprob_dump`; a non-zero loss-mask entry is 1."""
    n = len(train_log_probs)
    cols = {"train_log_probs": list(train_log_probs), "rollout_log_probs": list(rollout_log_probs),
            "loss_mask": None if loss_masks is None else [(torch.as_tensor(m) != 0).int() for m in loss_masks],
            "step": _per_seq(step, n, "step"), "sample_index": _per_seq(sample_index, n, "sample_index")}
    for key, col in cols.items():
        if col is not None and len(col) != n:
            raise ValueError(f"{key} has {len(col)} samples, train_log_probs has {n}")
    return [{k: col[i] for k, col in cols.items() if col is not None} for i in range(n)]


def _per_seq(value: Any, n: int, name: str) -> list | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.detach().cpu().reshape(-1).tolist()  # host-sync-ok (writing a dump)
    if isinstance(value, (int, float)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries, expected one per sequence ({n})")
    return value


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _as_list(x: Any, name: str, i: int) -> list:
    if isinstance(x, Tensor):
        if x.dim() > 1:
            raise DumpFormatError(f"record {i}: {name} must be a list or a 1-D tensor, got shape {list(x.shape)}")
        return x.detach().to("cpu").reshape(-1).tolist()  # host-sync-ok (writing a dump)
    if isinstance(x, (list, tuple)):
        return list(x)
    raise DumpFormatError(f"record {i}: {name} must be a list or a 1-D tensor, got {type(x).__name__} {_short(x)}")


def _number(v: Any, i: int, name: str, pos: int | None = None) -> float:
    """A JSON number (``null`` = NaN); bools and strings are errors."""
    at = "" if pos is None else f"[{pos}]"
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DumpFormatError(f"record {i}: {name}{at} must be a number, got {type(v).__name__} {_short(v)}")
    try:
        return float(v)
    except OverflowError:
        raise DumpFormatError(f"record {i}: {name}{at} = {v} overflows") from None


def _integer(v: Any, i: int, name: str, pos: int | None = None, *, lo: int = 0) -> int:
    """An integer in ``[lo, 2**63)``; an integral float (``3.0``) is accepted, ``3.5``, ``1e400``, bools and strings
    are not."""
    at = "" if pos is None else f"[{pos}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DumpFormatError(f"record {i}: {name}{at} must be an integer, got {type(v).__name__} {_short(v)}")
    if isinstance(v, float) and not (math.isfinite(v) and v == int(v)):
        raise DumpFormatError(f"record {i}: {name}{at} must be an integer, got {v!r}")
    v = int(v)
    if not lo <= v < 1 << 63:
        raise DumpFormatError(f"record {i}: {name}{at} = {v} is outside [{lo}, 2**63)")
    return v


def _token_values(x: Any, i: int, name: str, kind: str) -> list:
    """A per-token field of record ``i``: numbers (``null`` = NaN), integers ``>= 0`` or 0 / 1 (also ``true`` /
    ``false``, ``0.0`` / ``1.0``; the string ``"0"`` is an error); the first bad entry is named."""
    values = _as_list(x, name, i)
    if kind == "float":
        if all(type(v) is float or type(v) is int for v in values):  # fast path (no bool, str, None, list)
            try:
                return [float(v) for v in values]
            except OverflowError:
                pass
        return [_number(v, i, name, t) for t, v in enumerate(values)]
    if kind == "int":
        return [_integer(v, i, name, t) for t, v in enumerate(values)]
    for t, v in enumerate(values):
        if not (isinstance(v, (int, float)) and v in (0, 1)):  # bools are ints
            raise DumpFormatError(f"record {i}: {name}[{t}] must be 0 or 1, got {type(v).__name__} {_short(v)}")
    return [int(v) for v in values]


def _normalise(rec: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Record ``i`` checked against docs/dump_format.md, with every key of :data:`FIELDS` (absent: ``None`` or its
    default)."""
    if not isinstance(rec, Mapping):
        raise DumpFormatError(f"record {i} must be a JSON object / mapping, got {type(rec).__name__}")
    for key in _REQUIRED:
        if key not in rec:
            raise DumpFormatError(f"record {i} has no '{key}' (keys: {sorted(map(str, rec))[:12]})")
    out: dict[str, Any] = {}
    for key, (per, kind) in FIELDS.items():
        v = rec.get(key)
        if v is None:
            out[key] = None
        elif per == "token":
            out[key] = _token_values(v, i, key, kind)
        else:  # per sequence: an integer >= -1 (-1: unknown) or a number
            out[key] = _integer(v, i, key, lo=-1) if kind == "int" else _number(v, i, key)
    n = len(out["train_log_probs"])
    for key, (per, _) in FIELDS.items():
        if per == "token" and out[key] is not None and len(out[key]) != n:
            raise DumpFormatError(f"record {i}: {key} has {len(out[key])} entries but train_log_probs has {n}")
    if out["staleness"] is not None and out["staleness"] < 0:
        raise DumpFormatError(f"record {i}: staleness = {out['staleness']!r}: policy versions behind must be >= 0")
    for key, value in _DEFAULT.items():
        if out[key] is None:
            out[key] = [value] * n if FIELDS[key][0] == "token" else value
    return out


def _pack(recs: list[dict[str, Any]], meta: dict[str, Any]) -> LogprobDump:
    """Normalised records -> a dump: a per-token field only if every record has it, a per-sequence one (NaN where
    absent) if any has."""
    cols: dict[str, Tensor | None] = {}
    for key, (per, kind) in FIELDS.items():
        present = [r[key] is not None for r in recs]
        if key not in _ALWAYS and not (recs and (all(present) if per == "token" else any(present))):
            cols[key] = None
        elif per == "token":
            cols[key] = torch.tensor([v for r in recs for v in r[key]], dtype=_DTYPE[kind])
        else:
            cols[key] = torch.tensor([math.nan if r[key] is None else r[key] for r in recs], dtype=_DTYPE[kind])
    lengths = torch.tensor([len(r["train_log_probs"]) for r in recs], dtype=torch.int64)
    return LogprobDump(**cols, cu_seqlens=_cu(lengths), meta=meta)


def _records_of(dump: LogprobDump) -> list[dict[str, Any]]:
    """A dump's normalised records (NaN rewards and staleness left out)."""
    recs = records_from_packed(cu_seqlens=dump.cu_seqlens, **{k: getattr(dump, k) for k in FIELDS})
    return [_normalise(r, i) for i, r in enumerate(recs)]


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".pt"):
        raise DumpFormatError(f"dump path must end in .jsonl or .pt, got {str(path)!r}")
    return suffix


def write_logprob_dump(path: str | os.PathLike, records: Iterable[Mapping[str, Any]], *, append: bool = False,
                       meta: Mapping[str, Any] | None = None) -> int:
    """Write (or append) per-sequence records (docs/dump_format.md's ``.jsonl`` keys; lists or 1-D tensors) to
    ``path`` (``.jsonl`` or ``.pt``; parent directories created); ``meta`` goes into the header. Returns the number
    of records written."""
    path = Path(path)
    suffix = _suffix(path)
    meta = dict(meta or {})
    recs = [_normalise(r, i) for i, r in enumerate(records)]
    written = len(recs)
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".jsonl":
        new_file = not append or not path.exists() or path.stat().st_size == 0
        with open(path, "a" if append else "w", encoding="utf-8") as f:
            if new_file or meta:
                f.write(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, **meta}) + "\n")
            for r in recs:
                line = {k: v for k, v in r.items() if v is not None and not (k in ("step", "sample_index") and v < 0)}
                f.write(json.dumps(line) + "\n")
        return written
    if append and path.exists():  # re-read and re-write the file
        old = read_logprob_dump(path)
        recs = _records_of(old) + recs
        meta = {**old.meta, **meta}
    dump = _pack(recs, meta)
    payload = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "cu_seqlens": dump.cu_seqlens, "meta": dump.meta,
               **{k: getattr(dump, k) for k in FIELDS}}
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return written


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Normalised records, header meta and notes (a torn last line is dropped and noted) of a ``.jsonl`` dump."""
    recs: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    try:
        read = read_jsonl(path)
    except JSONLError as e:
        raise DumpFormatError(str(e)) from None
    for lineno, obj in read.rows:
        where = f"{path}:{lineno}"
        if not isinstance(obj, dict):
            raise DumpFormatError(f"{where}: expected a JSON object, got {type(obj).__name__} {_short(obj)}")
        if obj.get("format") is not None:
            meta.update(_header(obj, where))
            continue
        try:
            recs.append(_normalise(obj, len(recs)))
        except DumpFormatError as e:
            raise DumpFormatError(f"{where}: {e}") from None
    return recs, meta, [read.torn] if read.torn else []


def _header(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The meta fields of a header (``format`` / ``version`` checked)."""
    if obj.get("format") != FORMAT_NAME:
        raise DumpFormatError(f"{where}: unknown format {_short(obj.get('format'))} (expected {FORMAT_NAME!r})")
    version = obj.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise DumpFormatError(f"{where}: header field 'version' must be an integer, got {_short(version)}")
    if version > FORMAT_VERSION:
        raise DumpFormatError(f"{where}: dump version {version} is newer than {FORMAT_VERSION}")
    return {k: v for k, v in obj.items() if k not in ("format", "version")}


def _load_pt(path: Path) -> Any:
    """``torch.load(weights_only=True)``, then every tensor's size checked against what the file stores (a few bytes
    of an expanded view must not claim millions of elements) before anything is converted."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError / RuntimeError / EOFError ...
        raise DumpFormatError(
            f"{path}: cannot be read with torch.load(weights_only=True) ({type(e).__name__}: {str(e)[:200]}); "
            "dumps are read as plain tensors and containers only (no arbitrary pickled objects)") from None
    stack, seen = [(obj, "")], 0
    while stack:
        x, where = stack.pop()
        seen += 1
        if seen > _MAX_OBJECTS:
            raise DumpFormatError(f"{path}: more than {_MAX_OBJECTS} objects: not a dump")
        if isinstance(x, Tensor):
            need, have = x.numel() * x.element_size(), x.untyped_storage().nbytes()
            if need > have:
                raise DumpFormatError(
                    f"{path}: tensor {where or '(top level)'} claims {x.numel()} elements ({need} bytes) but the "
                    f"file stores {have} bytes for it (an expanded or overlapping view): not a dump")
        elif isinstance(x, Mapping):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, f"{where}[{j}]") for j, v in enumerate(x))
    return obj


def _pt_tensor(obj: Mapping[str, Any], key: str, path: Path, kind: str, length: int | None) -> Tensor:
    """``obj[key]``: a 1-D tensor of ``kind`` (:data:`FIELDS`) and ``length``."""
    x = obj.get(key)
    if not isinstance(x, Tensor):
        raise DumpFormatError(f"{path}: field '{key}' must be a 1-D tensor, got {type(x).__name__} {_short(x)}")
    if x.dim() != 1:
        raise DumpFormatError(f"{path}: field '{key}' must be a 1-D tensor, got shape {list(x.shape)}")
    if length is not None and x.numel() != length:
        raise DumpFormatError(f"{path}: field '{key}' has {x.numel()} entries, expected {length}")
    is_int = x.dtype in _INT_DTYPES
    ok = {"float": x.dtype.is_floating_point, "int": is_int,
          "mask": x.dtype == torch.bool or is_int or x.dtype.is_floating_point}[kind]
    if not ok:
        want = {"float": "a floating-point", "int": "an integer", "mask": "a bool or 0/1"}[kind]
        raise DumpFormatError(f"{path}: field '{key}' must be {want} tensor, got dtype {x.dtype}")
    if kind == "mask" and x.dtype != torch.bool and not bool(((x == 0) | (x == 1)).all()):
        raise DumpFormatError(f"{path}: field '{key}' must hold only 0 and 1")
    return x


def _pt_field(obj: Mapping[str, Any], key: str, path: Path, cu: Tensor) -> Tensor | None:
    """Field ``key`` of a ``.pt`` dump, checked (with the JSONL reader's bounds: ids ``>= 0``, ``step`` and
    ``sample_index`` ``>= -1``) and converted; an absent optional field is its default or ``None``."""
    per, kind = FIELDS[key]
    length = int(cu[-1]) if per == "token" else cu.numel() - 1
    if obj.get(key) is None and key not in _REQUIRED:
        return torch.full((length,), _DEFAULT[key], dtype=_DTYPE[kind]) if key in _DEFAULT else None
    x = _pt_tensor(obj, key, path, kind, length)
    if kind == "int":
        lo = 0 if per == "token" else -1
        bad = (x.to(torch.int64) < lo).nonzero()
        if bad.numel():
            at = int(bad[0, 0])
            if per == "token":
                rec = int(torch.searchsorted(cu, torch.tensor(at), right=True)) - 1
                where = f"record {rec}: {key}[{at - int(cu[rec])}]"
            else:
                where = f"record {at}: {key}"
            raise DumpFormatError(f"{path}: {where} = {int(x[at])} is below {lo}")
    return x.to(_DTYPE[kind])


def _read_pt(path: Path, obj: Any) -> LogprobDump:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        keys = sorted(map(str, obj))[:12] if isinstance(obj, dict) else type(obj).__name__
        raise DumpFormatError(f"{path}: not a {FORMAT_NAME} file (missing or wrong 'format' key) nor a slime debug "
                              f"dump (--save-debug-train-data, format_version 2); found {keys}")
    _header({"format": obj["format"], "version": obj.get("version", 1)}, str(path))
    cu = _pt_tensor(obj, "cu_seqlens", path, "int", None).to(torch.int64)
    if cu.numel() < 1:
        raise DumpFormatError(f"{path}: field 'cu_seqlens' is empty (it holds n + 1 boundaries, starting at 0)")
    t = _pt_tensor(obj, "train_log_probs", path, "float", None).numel()
    decreases = bool((cu[1:] < cu[:-1]).any())
    if int(cu[0]) != 0 or int(cu[-1]) != t or decreases:
        raise DumpFormatError(
            f"{path}: field 'cu_seqlens' must rise from 0 to the {t} tokens of train_log_probs "
            f"(starts at {int(cu[0])}, ends at {int(cu[-1])}{', decreases somewhere' if decreases else ''})")
    meta = obj.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise DumpFormatError(f"{path}: field 'meta' must be a dict, got {type(meta).__name__} {_short(meta)}")
    cols = {key: _pt_field(obj, key, path, cu) for key in FIELDS}
    return LogprobDump(**cols, cu_seqlens=cu, meta=dict(meta or {}))


def _read_slime(items: list[tuple[Path, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Normalised records and meta of slime debug dumps (merged by :func:`slime_records`)."""
    try:
        recs, meta = slime_records(items)
    except ValueError as e:
        raise DumpFormatError(str(e)) from None
    except (TypeError, OverflowError, KeyError, IndexError, RuntimeError) as e:  # a shape slime never writes
        files = ", ".join(str(p) for p, _ in items[:3]) + (", ..." if len(items) > 3 else "")
        raise DumpFormatError(f"{files}: malformed slime dump ({type(e).__name__}: {str(e)[:200]})") from None
    out = []
    for i, x in enumerate(recs):
        try:
            out.append(_normalise(x, i))
        except DumpFormatError as e:
            raise DumpFormatError(f"{x.get('_where', 'slime dump')}: {str(e).split(': ', 1)[-1]}") from None
    return out, meta


#: the dump a directory holds, by who wrote it: the example job's run directory, slime's debug-data directory
DIR_DUMPS = (("logprobs.jsonl", "the example job's run directory"), ("train_*.pt", "slime --save-debug-train-data"))


def _rollout_order(path: Path) -> tuple[int, str]:
    """Sort key of ``train_{rollout_id}[...].pt``: the rollout id as a number, then the name."""
    digits = path.stem.removeprefix("train_").split("_")[0]
    return (int(digits) if digits.isdigit() else -1, path.name)


def dump_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """``paths`` with each directory replaced by the files of the first pattern of :data:`DIR_DUMPS` it holds
    (``train_*.pt`` by rollout id); a directory holding none is an ``IsADirectoryError`` naming it."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            out.append(p)
            continue
        for pattern, _ in DIR_DUMPS:
            found = sorted((f for f in p.glob(pattern) if f.is_file()), key=_rollout_order)
            if found:
                out.extend(found)
                break
        else:
            looked = " or ".join(f"{pattern} ({who})" for pattern, who in DIR_DUMPS)
            raise IsADirectoryError(f"dump path {str(p)!r} is a directory holding no log-prob dump: "
                                    f"looked for {looked}")
    return out


def read_logprob_dump(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> LogprobDump:
    """One dump file, or several concatenated in order (slime debug dumps merged, after the others), as one
    :class:`LogprobDump`. A torn last ``.jsonl`` line is dropped and noted in ``notes``. Raises
    :class:`DumpFormatError`, ``FileNotFoundError`` or ``IsADirectoryError``."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    parts: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []  # (records, meta) of each file
    notes: list[str] = []
    slime_items: list[tuple[Path, Any]] = []
    for p in map(Path, paths):
        suffix = _suffix(p)
        if not p.exists():
            raise FileNotFoundError(f"dump file not found: {str(p)!r}")
        if not p.is_file():
            raise IsADirectoryError(f"dump path {str(p)!r} is a directory, not a file")
        if suffix == ".jsonl":
            recs, meta, torn = _read_jsonl(p)
            parts.append((recs, meta))
            notes.extend(torn)
            continue
        obj = _load_pt(p)
        if is_slime_dump(obj):
            slime_items.append((p, obj))  # merged below: several files may hold one rollout
            continue
        d = _read_pt(p, obj)
        if len(paths) == 1:
            return d
        parts.append((_records_of(d), d.meta))
    if slime_items:
        parts.append(_read_slime(slime_items))
    meta = {}
    for _, m in reversed(parts):  # the first value of each key wins
        meta.update(m)
    dump = _pack([r for recs, _ in parts for r in recs], meta)
    dump.notes = notes
    return dump
