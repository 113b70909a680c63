"""slime's own debug dumps (``--save-debug-train-data``, THUDM/slime at 624b824) -> per-sequence log-prob records.

The layouts read, the mapping to dump records, the merge of several files and what is refused (a
``--save-debug-rollout-data`` file, a dump without training log-probs): docs/dump_format.md, "slime's own dumps".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

__all__ = ["SLIME_WRITER", "is_slime_dump", "slime_records"]

SLIME_WRITER = "slime --save-debug-train-data"

_TRAIN_FLAG = "--save-debug-train-data"


def is_slime_dump(obj: Any) -> str | None:
    """``"train"`` (format_version 2), ``"train_legacy"`` (per-rank, before 681b3ad), ``"rollout"``
    (``--save-debug-rollout-data``) or ``None``."""
    if not isinstance(obj, Mapping):
        return None
    if obj.get("format_version") == 2 and isinstance(obj.get("samples"), list):
        return "train"
    if "rollout_data" in obj and isinstance(obj.get("rollout_data"), Mapping) and "rollout_id" in obj:
        return "train_legacy"
    if "format_version" not in obj and "rollout_id" in obj and isinstance(obj.get("samples"), list):
        return "rollout"
    return None


def _rollout_only_error(path: Path, obj: Mapping[str, Any]) -> ValueError:
    samples = obj["samples"]
    with_lp = sum(1 for s in samples if isinstance(s, Mapping) and s.get("rollout_log_probs") is not None)
    return ValueError(
        f"{path}: a slime --save-debug-rollout-data file (rollout {obj.get('rollout_id')}, {len(samples)} samples, "
        f"{with_lp} with rollout_log_probs): it holds SGLang's rollout log-probs but no training log-probs, and "
        "every importance ratio needs both. Get a train dump of the same data: run slime with "
        f"{_TRAIN_FLAG} DIR/train_{{rollout_id}}.pt (slime >= 681b3ad writes format_version 2 with per-sample "
        "log_probs and rollout_log_probs), or replay this very rollout through the trainer: "
        f"--load-debug-rollout-data <this file's path, with {{rollout_id}}> {_TRAIN_FLAG} DIR/train_{{rollout_id}}.pt "
        "(slime then trains without SGLang); then run slime-tis diagnose on DIR/train_*.pt")


def _no_train_logprobs_error(path: Path, rollout_id: Any) -> ValueError:
    return ValueError(
        f"{path}: slime train dump of rollout {rollout_id} has no training log-probs ('log_probs' is missing in "
        "its samples). slime stores them when it recomputes them before training, and, when it skips that pass "
        "(--use-rollout-logprobs, or a reusable training forward), when its own policy loss snapshots them "
        "from the training forward; a custom loss (--loss-type custom_loss, e.g. slime_tis algorithm 3 without a "
        "recompute) records them only if it does so itself. Re-run with the recompute (e.g. "
        "--get-mismatch-metrics) or with a loss that records them (docs/slime.md)")


def _as_values(x: Any, where: str, name: str, *, integer: bool = False) -> list[Any]:
    """A 1-D tensor or a list -> a plain list (values are checked by the dump reader)."""
    if isinstance(x, Tensor):
        if x.dim() > 1:
            raise ValueError(f"{where}: field '{name}' must be 1-D, got shape {list(x.shape)}")
        if x.dtype.is_complex or (integer and x.dtype.is_floating_point):
            raise ValueError(f"{where}: field '{name}' must be {'an integer' if integer else 'a real'} tensor, got "
                             f"dtype {x.dtype}")
        x = x.detach()
        return (x.reshape(-1) if integer else x.float().reshape(-1)).tolist()  # host-sync-ok (offline reader)
    if isinstance(x, (list, tuple)):
        types, kind = ((int,), "integers") if integer else ((int, float, type(None)), "numbers")
        for v in x:
            if isinstance(v, bool) or not isinstance(v, types):
                raise ValueError(f"{where}: field '{name}' must hold {kind}, found {type(v).__name__} {str(v)[:40]}")
        return list(x)
    raise ValueError(f"{where}: field '{name}' must be a list or a 1-D tensor, got {type(x).__name__}")


def _number(x: Any) -> float | None:
    if isinstance(x, Tensor) and x.numel() == 1 and not x.dtype.is_complex:
        return float(x)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return None


def _int_field(x: Any, where: str, name: str) -> int:
    """An integer field (a Python int or a one-element integer tensor); anything else names the field."""
    if isinstance(x, Tensor) and x.numel() == 1 and not (x.dtype.is_floating_point or x.dtype.is_complex):
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{where}: field '{name}' must be an integer, got {type(x).__name__} {str(x)[:40]}")
    return x


def _record(path: Path, rollout_id: int, i: int, s: Mapping[str, Any]) -> dict[str, Any] | None:
    """One slime sample dict -> one record (``None`` when it carries no training log-probs)."""
    if s.get("log_probs") is None:
        return None
    where = f"{path}: rollout {rollout_id}, sample {i}"
    if s.get("rollout_log_probs") is None:
        raise ValueError(f"{where} has no 'rollout_log_probs': the rollout did not keep SGLang's log-probs (slime's "
                         "SGLang rollout requests them; a custom generate function must fill Sample.rollout_log_probs)")
    train = _as_values(s["log_probs"], where, "log_probs")
    rollout = _as_values(s["rollout_log_probs"], where, "rollout_log_probs")
    length = _number(s.get("response_lengths", len(train)))
    length = int(length) if length is not None and math.isfinite(length) else len(train)
    if len(train) != length or len(rollout) != length:
        raise ValueError(
            f"{where}: log_probs has {len(train)} and rollout_log_probs {len(rollout)} entries for a response of "
            f"{length} tokens (context-parallel chunks that were not restored: a per-rank dump written with "
            f"context parallelism by slime before 681b3ad; dump again with {_TRAIN_FLAG} of slime >= 681b3ad)")
    rec: dict[str, Any] = {"train_log_probs": train, "rollout_log_probs": rollout, "step": rollout_id,
                           "_where": where}
    if s.get("loss_masks") is not None:
        rec["loss_mask"] = _as_values(s["loss_masks"], where, "loss_masks")
    tokens = s.get("tokens")
    if tokens is not None:
        ids = _as_values(tokens, where, "tokens", integer=True)
        if len(ids) >= length:
            rec["token_ids"] = ids[len(ids) - length :]
    name = "sample_index" if s.get("sample_index") is not None else "rollout_position"
    if s.get(name) is not None:
        rec["sample_index"] = _int_field(s[name], where, name)
    reward = _number(s.get("rewards"))
    if reward is not None:
        rec["reward"] = reward
    return rec


def _samples(kind: str, obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if kind == "train":
        return [s for s in obj["samples"] if isinstance(s, Mapping)]
    data = obj["rollout_data"]  # legacy per-rank: columns of per-sample lists
    lengths = data.get("response_lengths")
    n = len(lengths) if isinstance(lengths, (list, tuple)) else 0
    columns = {k: v for k, v in data.items() if isinstance(v, (list, tuple)) and len(v) == n}
    if "sample_indices" in columns:
        columns["sample_index"] = columns["sample_indices"]
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def _same(a: list[float], b: list[float]) -> bool:
    """Equal lists of numbers, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def slime_records(items: Sequence[tuple[Path, Mapping[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records and header meta of slime dump files (``(path, loaded object)`` pairs), merged; what is refused, with
    a ``ValueError`` naming the file: docs/dump_format.md, "slime's own dumps"."""
    merged: dict[tuple[Any, ...], tuple[Path, dict[str, Any]]] = {}
    seen_rollouts: dict[int, Path] = {}
    with_train: set[int] = set()
    for path, obj in items:
        kind = is_slime_dump(obj)
        if kind == "rollout":
            raise _rollout_only_error(path, obj)
        if kind is None:
            raise ValueError(f"{path}: not a slime debug dump")
        rollout_id = _int_field(obj["rollout_id"], str(path), "rollout_id")
        seen_rollouts.setdefault(rollout_id, path)
        for i, s in enumerate(_samples(kind, obj)):
            rec = _record(path, rollout_id, i, s)
            if rec is None:
                continue  # a pipeline stage / rank that computed no log-probs (legacy per-rank files)
            with_train.add(rollout_id)
            key = (rollout_id, rec["sample_index"]) if "sample_index" in rec else (
                rollout_id, "tokens", tuple(rec.get("token_ids") or ()), len(rec["train_log_probs"]))
            if key in merged:
                first, old = merged[key]
                if not (_same(old["train_log_probs"], rec["train_log_probs"])
                        and _same(old["rollout_log_probs"], rec["rollout_log_probs"])):
                    raise ValueError(f"{path}: rollout {rollout_id} sample {key[1:]} differs from the same sample in "
                                     f"{first} (files of different runs?)")
                continue
            merged[key] = (path, rec)
    for rollout_id, path in seen_rollouts.items():
        if rollout_id not in with_train:
            raise _no_train_logprobs_error(path, rollout_id)
    order = sorted(merged, key=lambda k: (k[0], k[1] if isinstance(k[1], int) else math.inf))
    return [merged[k][1] for k in order], {"writer": SLIME_WRITER, "rollouts": sorted(seen_rollouts)}
