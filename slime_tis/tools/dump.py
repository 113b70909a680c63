"""Log-prob dumps: rollout (SGLang) and training (Megatron) log-probs per response token, on disk.

The layout is documented in ``docs/dump_format.md``; ``slime-tis diagnose`` reads it, the example job
and the slime hooks write it. Two encodings, chosen by the file suffix:

* ``.jsonl``: one JSON object per line. A line with ``"format": "slime_tis.logprob_dump"`` is a
  header (optional, may repeat when several writers append); every other line is one sequence::

      {"train_log_probs": [..R floats..], "rollout_log_probs": [..R..], "loss_mask": [..R 0/1..],
       "step": 3, "sample_index": 17, "token_ids": [..R ints..], "reward": 1.0}

  ``loss_mask`` defaults to all ones; ``step``, ``sample_index``, ``token_ids``, ``reward`` are
  optional. NaN / +-inf are written as the tokens ``NaN`` / ``Infinity`` / ``-Infinity`` (what
  Python's ``json`` emits and reads); ``null`` is read as NaN. Appending is a plain file append.
* ``.pt``: ``torch.save`` of one dict in the packed layout of the core::

      {"format": "slime_tis.logprob_dump", "version": 1,
       "train_log_probs": float32 [T], "rollout_log_probs": float32 [T], "loss_mask": bool [T],
       "cu_seqlens": int64 [n+1], "step": int64 [n], "sample_index": int64 [n],
       "token_ids": int64 [T] or None, "reward": float32 [n] or None, "meta": dict}

  Appending re-reads and re-writes the file (fine for diagnostics-sized dumps; use ``.jsonl`` to
  append every step of a long run).

Missing per-sequence integers are stored as ``-1`` and missing rewards as NaN.

:func:`read_logprob_dump` also reads slime's own ``--save-debug-train-data`` files (``.pt``, see
:mod:`slime_tis.tools.slime_dump`), merging several files of one rollout.
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

__all__ = [
    "DumpFormatError",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LogprobDump",
    "read_logprob_dump",
    "records_from_packed",
    "records_from_samples",
    "write_logprob_dump",
    "dump_files",
]

class DumpFormatError(ValueError):
    """A dump (or one of its records) is malformed; the message names the file, record and field."""


FORMAT_NAME = "slime_tis.logprob_dump"
FORMAT_VERSION = 1
_SUFFIXES = (".jsonl", ".pt")


@dataclass
class LogprobDump:
    """A dump in the packed layout (n sequences, T tokens in all).

    Attributes:
        train_log_probs: ``[T]`` float32, the trainer's log-probs (``lp_old`` or ``sg(lp_theta)``).
        rollout_log_probs: ``[T]`` float32, SGLang's log-probs of the same tokens.
        loss_mask: ``[T]`` bool, 1 = trainable token.
        cu_seqlens: ``[n + 1]`` int64 sequence boundaries.
        step: ``[n]`` int64 training step of each sequence (``-1`` unknown).
        sample_index: ``[n]`` int64 sample id within its step (``-1`` unknown).
        token_ids: ``[T]`` int64 or None.
        reward: ``[n]`` float32 or None (NaN where unknown).
        rollout_log_mass: ``[T]`` float32 or None: log of the probability mass the rollout's sampler kept at each
            token (top-p / top-k; SGLang's ``output_token_logprobs - output_token_sampling_logprobs``, 0 untruncated;
            docs/sampling_support.md).
        routing_differs: ``[T]`` bool or None: True where the trainer's router chose another expert set than the
            rollout engine at some MoE layer (the token's routing mismatch).
        staleness: ``[n]`` float32 or None: policy versions between the rollout's policy and the trainer's (0 =
            on-policy; NaN where unknown).
        meta: header fields (free-form, e.g. ``{"train_policy": "old", "temperature": 1.0}``).
        notes: what the reader tolerated and the user should know (e.g. a torn last line that was
            dropped), one sentence each.
    """

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
    def n_tokens(self) -> int:
        return int(self.train_log_probs.numel())

    @property
    def lengths(self) -> Tensor:
        """``[n]`` int64 response lengths (all tokens, masked or not)."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def valid_lengths(self) -> Tensor:
        """``[n]`` int64 number of tokens with ``loss_mask = 1`` per sequence."""
        seq_id = torch.repeat_interleave(torch.arange(self.n_seq), self.lengths)
        out = torch.zeros(self.n_seq, dtype=torch.int64)
        return out.index_add_(0, seq_id, self.loss_mask.to(torch.int64))

    def select(self, seq_keep: Tensor) -> LogprobDump:
        """The sub-dump of the sequences where ``seq_keep [n]`` (bool) is true."""
        seq_keep = seq_keep.to(torch.bool)
        tok_keep = torch.repeat_interleave(seq_keep, self.lengths)
        lengths = self.lengths[seq_keep]
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        return LogprobDump(
            train_log_probs=self.train_log_probs[tok_keep],
            rollout_log_probs=self.rollout_log_probs[tok_keep],
            loss_mask=self.loss_mask[tok_keep],
            cu_seqlens=cu,
            step=self.step[seq_keep],
            sample_index=self.sample_index[seq_keep],
            token_ids=None if self.token_ids is None else self.token_ids[tok_keep],
            reward=None if self.reward is None else self.reward[seq_keep],
            rollout_log_mass=None if self.rollout_log_mass is None else self.rollout_log_mass[tok_keep],
            routing_differs=None if self.routing_differs is None else self.routing_differs[tok_keep],
            staleness=None if self.staleness is None else self.staleness[seq_keep],
            meta=dict(self.meta),
            notes=list(self.notes),
        )


# ----------------------------------------------------------------------------------------------
# record helpers
# ----------------------------------------------------------------------------------------------
def _as_list(x: Any, name: str, i: int) -> list:
    if isinstance(x, Tensor):
        if x.dim() > 1:
            raise DumpFormatError(f"record {i}: {name} must be a list or a 1-D tensor, got shape {list(x.shape)}")
        return x.detach().to("cpu").reshape(-1).tolist()  # host-sync-ok (writing a dump)
    if isinstance(x, (list, tuple)):
        return list(x)
    raise DumpFormatError(f"record {i}: {name} must be a list or a 1-D tensor, got {type(x).__name__} {_short(x)}")


def records_from_packed(
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    *,
    step: int | Sequence[int] | Tensor | None = None,
    sample_index: Sequence[int] | Tensor | None = None,
    token_ids: Tensor | None = None,
    reward: Sequence[float] | Tensor | None = None,
    rollout_log_mass: Tensor | None = None,
    routing_differs: Tensor | None = None,
    staleness: Sequence[float] | Tensor | None = None,
) -> list[dict[str, Any]]:
    """Split packed ``[T]`` tensors (core layout) into per-sequence records for :func:`write_logprob_dump`.

    ``step`` is one int for the whole batch or one per sequence. Host-side helper (copies to CPU).
    """
    cu = cu_seqlens.detach().to("cpu", torch.int64).tolist()  # host-sync-ok (writing a dump)
    n = len(cu) - 1
    tl = train_log_probs.detach().float().cpu()  # host-sync-ok (dump file)
    rl = rollout_log_probs.detach().float().cpu()  # host-sync-ok (dump file)
    lm = loss_mask.detach().cpu()  # host-sync-ok (dump file)
    ids = None if token_ids is None else token_ids.detach().cpu()  # host-sync-ok (dump file)
    mass = None if rollout_log_mass is None else rollout_log_mass.detach().float().cpu()  # host-sync-ok (dump)
    steps = _per_seq(step, n, "step")
    idx = _per_seq(sample_index, n, "sample_index")
    rew = _per_seq(reward, n, "reward")
    stale = _per_seq(staleness, n, "staleness")
    differs = None if routing_differs is None else routing_differs.detach().cpu()  # host-sync-ok (dump file)
    out = []
    for i in range(n):
        a, b = cu[i], cu[i + 1]
        rec: dict[str, Any] = {
            "train_log_probs": tl[a:b].tolist(),  # host-sync-ok (dump file)
            "rollout_log_probs": rl[a:b].tolist(),  # host-sync-ok (dump file)
            "loss_mask": [int(v) for v in (lm[a:b] != 0).tolist()],  # host-sync-ok (dump file)
        }
        if steps is not None:
            rec["step"] = int(steps[i])
        if idx is not None:
            rec["sample_index"] = int(idx[i])
        if ids is not None:
            rec["token_ids"] = ids[a:b].tolist()  # host-sync-ok (dump file)
        if rew is not None:
            rec["reward"] = float(rew[i])
        if mass is not None:
            rec["rollout_log_mass"] = mass[a:b].tolist()  # host-sync-ok (dump file)
        if differs is not None:
            rec["routing_differs"] = [int(v) for v in (differs[a:b] != 0).tolist()]  # host-sync-ok (dump file)
        if stale is not None and not math.isnan(float(stale[i])):
            rec["staleness"] = float(stale[i])
        out.append(rec)
    return out


def records_from_samples(
    train_log_probs: Sequence[Tensor],
    rollout_log_probs: Sequence[Tensor],
    loss_masks: Sequence[Tensor] | None = None,
    *,
    step: int | Sequence[int] | None = None,
    sample_index: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Per-sample lists of full-length ``[R_i]`` tensors (slime's layout, CP already gathered) -> records."""
    if len(train_log_probs) != len(rollout_log_probs):
        raise ValueError(
            f"train_log_probs has {len(train_log_probs)} samples, rollout_log_probs has {len(rollout_log_probs)}"
        )
    n = len(train_log_probs)
    if loss_masks is not None and len(loss_masks) != n:
        raise ValueError(f"loss_masks has {len(loss_masks)} samples, expected {n}")
    steps = _per_seq(step, n, "step")
    idx = _per_seq(sample_index, n, "sample_index")
    out = []
    for i in range(n):
        rec: dict[str, Any] = {
            "train_log_probs": _as_list(train_log_probs[i], "train_log_probs", i),
            "rollout_log_probs": _as_list(rollout_log_probs[i], "rollout_log_probs", i),
        }
        if loss_masks is not None:
            rec["loss_mask"] = [int(v != 0) for v in _as_list(loss_masks[i], "loss_mask", i)]
        if steps is not None:
            rec["step"] = int(steps[i])
        if idx is not None:
            rec["sample_index"] = int(idx[i])
        out.append(rec)
    return out


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


# ----------------------------------------------------------------------------------------------
# normalisation of records
# ----------------------------------------------------------------------------------------------
_INT64_MAX = (1 << 63) - 1


def _number(v: Any, i: int, name: str, pos: int | None = None) -> float:
    """A JSON number (``null`` = NaN); bools and strings are errors."""
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        at = "" if pos is None else f"[{pos}]"
        raise DumpFormatError(f"record {i}: {name}{at} must be a number, got {type(v).__name__} {_short(v)}")
    try:
        return float(v)
    except OverflowError:
        raise DumpFormatError(f"record {i}: {name}{'' if pos is None else f'[{pos}]'} = {v} overflows") from None


def _numbers(values: list, i: int, name: str) -> list[float]:
    """A list of JSON numbers (``null`` = NaN) as floats; the first bad entry is named."""
    if all(type(v) is float or type(v) is int for v in values):  # fast path (no bool, str, None, list)
        try:
            return [float(v) for v in values]
        except OverflowError:
            pass
    return [_number(v, i, name, t) for t, v in enumerate(values)]


def _integer(v: Any, i: int, name: str, pos: int | None = None, *, lo: int = 0) -> int:
    """An integer in ``[lo, 2**63)`` (an integral float such as ``3.0`` is accepted; ``3.5``, ``1e400``,
    bools and strings are errors)."""
    at = "" if pos is None else f"[{pos}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DumpFormatError(f"record {i}: {name}{at} must be an integer, got {type(v).__name__} {_short(v)}")
    if isinstance(v, float) and not (math.isfinite(v) and v == int(v)):
        raise DumpFormatError(f"record {i}: {name}{at} must be an integer, got {v!r}")
    v = int(v)
    if not lo <= v <= _INT64_MAX:
        raise DumpFormatError(f"record {i}: {name}{at} = {v} is outside [{lo}, 2**63)")
    return v


def _mask_value(v: Any, i: int, pos: int) -> int:
    """A loss-mask entry: ``0`` / ``1`` / ``true`` / ``false`` (also ``0.0`` / ``1.0``); anything else is
    an error (a string ``"0"`` would otherwise read as 1)."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)) and v in (0, 1):
        return int(v)
    raise DumpFormatError(f"record {i}: loss_mask[{pos}] must be 0 or 1, got {type(v).__name__} {_short(v)}")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _normalise(rec: Mapping[str, Any], i: int) -> dict[str, Any]:
    if not isinstance(rec, Mapping):
        raise DumpFormatError(f"record {i} must be a JSON object / mapping, got {type(rec).__name__}")
    for key in ("train_log_probs", "rollout_log_probs"):
        if key not in rec:
            raise DumpFormatError(f"record {i} has no '{key}' (keys: {sorted(map(str, rec))[:12]})")
    train = _numbers(_as_list(rec["train_log_probs"], "train_log_probs", i), i, "train_log_probs")
    rollout = _numbers(_as_list(rec["rollout_log_probs"], "rollout_log_probs", i), i, "rollout_log_probs")
    if len(train) != len(rollout):
        raise DumpFormatError(
            f"record {i}: train_log_probs has {len(train)} tokens but rollout_log_probs has {len(rollout)}"
        )
    mask = rec.get("loss_mask")
    if mask is None:
        mask = [1] * len(train)
    else:
        mask = _as_list(mask, "loss_mask", i)
        if not all(v is True or v is False or (type(v) is int and 0 <= v <= 1) for v in mask):
            mask = [_mask_value(v, i, t) for t, v in enumerate(mask)]
        mask = [int(v) for v in mask]
    if len(mask) != len(train):
        raise DumpFormatError(f"record {i}: loss_mask has {len(mask)} entries but the log-probs have {len(train)}")
    ids = rec.get("token_ids")
    if ids is not None:
        ids = [_integer(v, i, "token_ids", t) for t, v in enumerate(_as_list(ids, "token_ids", i))]
        if len(ids) != len(train):
            raise DumpFormatError(
                f"record {i}: token_ids has {len(ids)} entries but the log-probs have {len(train)}"
            )
    mass = rec.get("rollout_log_mass")
    if mass is not None:
        mass = _numbers(_as_list(mass, "rollout_log_mass", i), i, "rollout_log_mass")
        if len(mass) != len(train):
            raise DumpFormatError(
                f"record {i}: rollout_log_mass has {len(mass)} entries but the log-probs have {len(train)}")
    differs = rec.get("routing_differs")
    if differs is not None:
        differs = [_integer(v, i, "routing_differs", t) for t, v in enumerate(_as_list(differs, "routing_differs", i))]
        if len(differs) != len(train) or any(v not in (0, 1) for v in differs):
            raise DumpFormatError(f"record {i}: routing_differs must hold {len(train)} entries of 0 / 1 (one per "
                                  f"log-prob), got {len(differs)} {_short(differs)}")
    stale = rec.get("staleness")
    if stale is not None:
        stale = _number(stale, i, "staleness")
        if not math.isnan(stale) and stale < 0:
            raise DumpFormatError(f"record {i}: staleness = {stale!r}: policy versions behind must be >= 0")
    reward = rec.get("reward")
    step, index = rec.get("step"), rec.get("sample_index")
    return {
        "train_log_probs": train,
        "rollout_log_probs": rollout,
        "loss_mask": mask,
        "step": -1 if step is None else _integer(step, i, "step", lo=-1),
        "sample_index": -1 if index is None else _integer(index, i, "sample_index", lo=-1),
        "token_ids": ids,
        "reward": None if reward is None else _number(reward, i, "reward"),
        "rollout_log_mass": mass,
        "routing_differs": differs,
        "staleness": stale,
    }


def _pack(recs: list[dict[str, Any]], meta: dict[str, Any]) -> LogprobDump:
    lengths = [len(r["train_log_probs"]) for r in recs]
    cu = torch.zeros(len(recs) + 1, dtype=torch.int64)
    if recs:
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)

    def cat(key: str, dtype: torch.dtype) -> Tensor:
        flat = [v for r in recs for v in r[key]]
        return torch.tensor(flat, dtype=dtype)

    have_ids = bool(recs) and all(r["token_ids"] is not None for r in recs)
    have_reward = any(r["reward"] is not None for r in recs)
    have_mass = bool(recs) and all(r["rollout_log_mass"] is not None for r in recs)
    have_differs = bool(recs) and all(r.get("routing_differs") is not None for r in recs)
    have_stale = any(r.get("staleness") is not None for r in recs)
    return LogprobDump(
        train_log_probs=cat("train_log_probs", torch.float32),
        rollout_log_probs=cat("rollout_log_probs", torch.float32),
        loss_mask=cat("loss_mask", torch.bool),
        cu_seqlens=cu,
        step=torch.tensor([r["step"] for r in recs], dtype=torch.int64),
        sample_index=torch.tensor([r["sample_index"] for r in recs], dtype=torch.int64),
        token_ids=cat("token_ids", torch.int64) if have_ids else None,
        reward=(
            torch.tensor([math.nan if r["reward"] is None else r["reward"] for r in recs], dtype=torch.float32)
            if have_reward
            else None
        ),
        rollout_log_mass=cat("rollout_log_mass", torch.float32) if have_mass else None,
        routing_differs=cat("routing_differs", torch.bool) if have_differs else None,
        staleness=(torch.tensor([math.nan if r.get("staleness") is None else r["staleness"] for r in recs],
                                dtype=torch.float32) if have_stale else None),
        meta=meta,
    )


def _records_of(dump: LogprobDump) -> list[dict[str, Any]]:
    recs = records_from_packed(
        dump.train_log_probs,
        dump.rollout_log_probs,
        dump.loss_mask,
        dump.cu_seqlens,
        step=dump.step,
        sample_index=dump.sample_index,
        token_ids=dump.token_ids,
        reward=dump.reward,
        rollout_log_mass=dump.rollout_log_mass,
        routing_differs=dump.routing_differs,
        staleness=dump.staleness,
    )
    for r in recs:
        if r.get("reward") is not None and math.isnan(r["reward"]):
            del r["reward"]
    return recs


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise DumpFormatError(f"dump path must end in .jsonl or .pt, got {str(path)!r}")
    return suffix


# ----------------------------------------------------------------------------------------------
# write / read
# ----------------------------------------------------------------------------------------------
def write_logprob_dump(
    path: str | os.PathLike,
    records: Iterable[Mapping[str, Any]] | LogprobDump,
    *,
    append: bool = False,
    meta: Mapping[str, Any] | None = None,
) -> int:
    """Write (or append) per-sequence records to ``path`` (``.jsonl`` or ``.pt``); return the count written.

    Each record is a mapping with ``train_log_probs`` and ``rollout_log_probs`` (lists or 1-D
    tensors of the same length ``R``), and optionally ``loss_mask`` ``[R]``, ``step``,
    ``sample_index``, ``token_ids`` ``[R]``, ``reward``, ``rollout_log_mass`` ``[R]``. ``meta`` goes into the
    header (e.g. ``{"train_policy": "old", "algorithm": 2, "temperature": 1.0}``). Raises ``ValueError`` naming the
    record and field on malformed input. Parent directories are created.
    """
    path = Path(path)
    suffix = _suffix(path)
    if isinstance(records, LogprobDump):
        meta = {**records.meta, **(meta or {})}
        records = _records_of(records)
    recs = [_normalise(r, i) for i, r in enumerate(records)]
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **(dict(meta) if meta else {})}
    if suffix == ".jsonl":
        new_file = not append or not path.exists() or path.stat().st_size == 0
        with open(path, "a" if append else "w", encoding="utf-8") as f:
            if new_file or meta:
                f.write(json.dumps(header) + "\n")
            for r in recs:
                line = {k: v for k, v in r.items() if v is not None and not (k in ("step", "sample_index") and v < 0)}
                f.write(json.dumps(line) + "\n")
        return len(recs)
    old_recs: list[dict[str, Any]] = []
    old_meta: dict[str, Any] = {}
    if append and path.exists():
        old = read_logprob_dump(path)
        old_recs = [_normalise(r, i) for i, r in enumerate(_records_of(old))]
        old_meta = old.meta
    dump = _pack(old_recs + recs, {**old_meta, **(dict(meta) if meta else {})})
    payload = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "train_log_probs": dump.train_log_probs,
        "rollout_log_probs": dump.rollout_log_probs,
        "loss_mask": dump.loss_mask,
        "cu_seqlens": dump.cu_seqlens,
        "step": dump.step,
        "sample_index": dump.sample_index,
        "token_ids": dump.token_ids,
        "reward": dump.reward,
        "rollout_log_mass": dump.rollout_log_mass,
        "routing_differs": dump.routing_differs,
        "staleness": dump.staleness,
        "meta": dump.meta,
    }
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return len(recs)


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Records, header meta and notes (a torn last line is dropped and noted) of a ``.jsonl`` dump."""
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
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError / RuntimeError / EOFError ...
        raise DumpFormatError(
            f"{path}: cannot be read with torch.load(weights_only=True) ({type(e).__name__}: {str(e)[:200]}); "
            "dumps are read as plain tensors and containers only (no arbitrary pickled objects)"
        ) from None
    _check_storage(obj, path)
    return obj


def _check_storage(obj: Any, path: Path) -> None:
    """Refuse a tensor whose elements are not all stored in the file (an expanded / overlapping view:
    a few bytes on disk that claim millions of elements) before anything is converted or allocated."""
    stack, seen = [(obj, "")], 0
    while stack:
        x, where = stack.pop()
        seen += 1
        if seen > _MAX_OBJECTS:
            raise DumpFormatError(f"{path}: more than {_MAX_OBJECTS} objects: not a dump")
        if isinstance(x, Tensor):
            need = x.numel() * x.element_size()
            have = x.untyped_storage().nbytes()
            if need > have:
                raise DumpFormatError(
                    f"{path}: tensor {where or '(top level)'} claims {x.numel()} elements ({need} bytes) but the "
                    f"file stores {have} bytes for it (an expanded or overlapping view): not a dump"
                )
        elif isinstance(x, Mapping):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, f"{where}[{j}]") for j, v in enumerate(x))


_MAX_OBJECTS = 50_000_000
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _pt_tensor(obj: Mapping[str, Any], key: str, path: Path, *, kind: str, length: int | None,
               optional: bool = False) -> Tensor | None:
    """``obj[key]`` checked: a 1-D tensor of the right kind (``"float"``, ``"int"``, ``"mask"``) and
    length; ``None`` allowed when ``optional``."""
    x = obj.get(key)
    if x is None and optional:
        return None
    if not isinstance(x, Tensor):
        raise DumpFormatError(f"{path}: field '{key}' must be a 1-D tensor, got {type(x).__name__} {_short(x)}")
    if x.dim() != 1:
        raise DumpFormatError(f"{path}: field '{key}' must be a 1-D tensor, got shape {list(x.shape)}")
    if length is not None and x.numel() != length:
        raise DumpFormatError(f"{path}: field '{key}' has {x.numel()} entries, expected {length}")
    ok = {
        "float": x.dtype.is_floating_point,
        "int": x.dtype in _INT_DTYPES,
        "mask": x.dtype == torch.bool or x.dtype in _INT_DTYPES or x.dtype.is_floating_point,
    }[kind]
    if not ok:
        want = {"float": "a floating-point", "int": "an integer", "mask": "a bool or 0/1"}[kind]
        raise DumpFormatError(f"{path}: field '{key}' must be {want} tensor, got dtype {x.dtype}")
    if kind == "mask" and x.dtype != torch.bool and not bool(((x == 0) | (x == 1)).all()):
        raise DumpFormatError(f"{path}: field 'loss_mask' must hold only 0 and 1")
    return x


def _pt_lower_bound(x: Tensor | None, key: str, lo: int, path: Path, cu: Tensor | None) -> None:
    """Refuse an integer field of a ``.pt`` dump with an entry below ``lo`` (the bound the JSONL reader
    applies), naming the record and, for a per-token field (``cu`` given), the position in it."""
    if x is None:
        return
    bad = (x.to(torch.int64) < lo).nonzero()
    if bad.numel() == 0:
        return
    at = int(bad[0, 0])
    value = int(x[at])
    if cu is None:
        where = f"record {at}: {key}"
    else:
        rec = int(torch.searchsorted(cu, torch.tensor(at), right=True)) - 1
        where = f"record {rec}: {key}[{at - int(cu[rec])}]"
    raise DumpFormatError(f"{path}: {where} = {value} is below {lo}")


def _read_pt(path: Path, obj: Any) -> LogprobDump:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        keys = sorted(map(str, obj))[:12] if isinstance(obj, dict) else type(obj).__name__
        raise DumpFormatError(
            f"{path}: not a {FORMAT_NAME} file (missing or wrong 'format' key) nor a slime debug dump "
            f"(--save-debug-train-data, format_version 2); found {keys}"
        )
    _header({"format": obj["format"], "version": obj.get("version", 1)}, str(path))
    cu = _pt_tensor(obj, "cu_seqlens", path, kind="int", length=None)
    if cu.numel() < 1:
        raise DumpFormatError(f"{path}: field 'cu_seqlens' is empty (it holds n + 1 boundaries, starting at 0)")
    train = _pt_tensor(obj, "train_log_probs", path, kind="float", length=None)
    t = train.numel()
    rollout = _pt_tensor(obj, "rollout_log_probs", path, kind="float", length=t)
    mask = _pt_tensor(obj, "loss_mask", path, kind="mask", length=t)
    cu = cu.to(torch.int64)
    decreases = bool((cu[1:] < cu[:-1]).any())
    if int(cu[0]) != 0 or int(cu[-1]) != t or decreases:
        raise DumpFormatError(
            f"{path}: field 'cu_seqlens' must rise from 0 to the {t} tokens of train_log_probs "
            f"(starts at {int(cu[0])}, ends at {int(cu[-1])}{', decreases somewhere' if decreases else ''})"
        )
    n = cu.numel() - 1
    step = _pt_tensor(obj, "step", path, kind="int", length=n, optional=True)
    idx = _pt_tensor(obj, "sample_index", path, kind="int", length=n, optional=True)
    ids = _pt_tensor(obj, "token_ids", path, kind="int", length=t, optional=True)
    reward = _pt_tensor(obj, "reward", path, kind="float", length=n, optional=True)
    mass = _pt_tensor(obj, "rollout_log_mass", path, kind="float", length=t, optional=True)
    differs = _pt_tensor(obj, "routing_differs", path, kind="mask", length=t, optional=True)
    stale = _pt_tensor(obj, "staleness", path, kind="float", length=n, optional=True)
    _pt_lower_bound(step, "step", -1, path, None)
    _pt_lower_bound(idx, "sample_index", -1, path, None)
    _pt_lower_bound(ids, "token_ids", 0, path, cu)
    meta = obj.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise DumpFormatError(f"{path}: field 'meta' must be a dict, got {type(meta).__name__} {_short(meta)}")
    return LogprobDump(
        train_log_probs=train.float(),
        rollout_log_probs=rollout.float(),
        loss_mask=mask.to(torch.bool),
        cu_seqlens=cu,
        step=step.to(torch.int64) if step is not None else torch.full((n,), -1, dtype=torch.int64),
        sample_index=idx.to(torch.int64) if idx is not None else torch.full((n,), -1, dtype=torch.int64),
        token_ids=None if ids is None else ids.to(torch.int64),
        reward=None if reward is None else reward.float(),
        rollout_log_mass=None if mass is None else mass.float(),
        routing_differs=None if differs is None else differs.to(torch.bool),
        staleness=None if stale is None else stale.float(),
        meta=dict(meta or {}),
    )


#: the dump a directory holds, by who wrote it: the example job's run directory, slime's debug-data directory
DIR_DUMPS = (("logprobs.jsonl", "the example job's run directory"), ("train_*.pt", "slime --save-debug-train-data"))


def _rollout_order(path: Path) -> tuple[int, str]:
    """Sort key of ``train_{rollout_id}[...].pt``: the rollout id as a number, then the name."""
    digits = path.stem.removeprefix("train_").split("_")[0]
    return (int(digits) if digits.isdigit() else -1, path.name)


def dump_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """``paths`` with every directory replaced by the dump files it holds (files stay as given): the first of
    :data:`DIR_DUMPS` found, ``DIR/logprobs.jsonl`` (the example job's run directory) or else ``DIR/train_*.pt``
    (slime's ``--save-debug-train-data`` files, by rollout id). A directory holding neither is an
    ``IsADirectoryError`` naming it and what was looked for."""
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
            raise IsADirectoryError(
                f"dump path {str(p)!r} is a directory holding no log-prob dump: looked for {looked}"
            )
    return out


def read_logprob_dump(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> LogprobDump:
    """Read one dump file, or several (concatenated in order), into one :class:`LogprobDump`.

    ``.pt`` files may also be slime's ``--save-debug-train-data`` dumps (:mod:`slime_tis.tools.slime_dump`):
    all of them are merged (several files of one rollout included) and follow the other files.

    A torn last line of a ``.jsonl`` file (no newline, not valid JSON: a write cut short) is dropped and
    reported in ``LogprobDump.notes``. Raises :class:`DumpFormatError` (a ``ValueError``) naming the file,
    the line or record and the field on malformed content, ``FileNotFoundError`` for a missing file and
    ``IsADirectoryError`` for a directory.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    recs: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    notes: list[str] = []
    slime_items: list[tuple[Path, Any]] = []
    for p in paths:
        p = Path(p)
        suffix = _suffix(p)
        if not p.exists():
            raise FileNotFoundError(f"dump file not found: {str(p)!r}")
        if not p.is_file():
            raise IsADirectoryError(f"dump path {str(p)!r} is a directory, not a file")
        if suffix == ".jsonl":
            r, m, n = _read_jsonl(p)
            notes.extend(n)
        else:
            obj = _load_pt(p)
            if is_slime_dump(obj):
                slime_items.append((p, obj))  # merged below: several files may hold one rollout
                continue
            d = _read_pt(p, obj)
            if len(paths) == 1:
                return d
            r, m = [_normalise(x, i) for i, x in enumerate(_records_of(d))], d.meta
        recs.extend(r)
        for k, v in m.items():
            meta.setdefault(k, v)
    if slime_items:
        try:
            r, m = slime_records(slime_items)
        except ValueError as e:
            raise DumpFormatError(str(e)) from None
        except (TypeError, OverflowError, KeyError, IndexError, RuntimeError) as e:  # a shape slime never writes
            files = ", ".join(str(p) for p, _ in slime_items[:3]) + (", ..." if len(slime_items) > 3 else "")
            raise DumpFormatError(f"{files}: malformed slime dump ({type(e).__name__}: {str(e)[:200]})") from None
        for i, x in enumerate(r):
            try:
                recs.append(_normalise(x, i))
            except DumpFormatError as e:
                raise DumpFormatError(f"{x.get('_where', 'slime dump')}: {str(e).split(': ', 1)[-1]}") from None
        for k, v in m.items():
            meta.setdefault(k, v)
    dump = _pack(recs, meta)
    dump.notes = notes
    return dump
