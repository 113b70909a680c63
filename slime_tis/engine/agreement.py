"""Settings every rank must share (the resolved ``TISConfig``, :func:`config_settings`, and the host's own), compared
across ranks once, before any data-dependent collective: one all-gather of two 63-bit BLAKE2b digests per rank; only
when they differ a second all-gather of the per-setting digests, and every rank raises ``ValueError`` naming each
differing setting, its own value and which ranks hold which. Settings found equal on a group are remembered per
process (checking them again issues no collective). docs/megatron.md, "What the wrapped forward_backward does".
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from slime_tis.config import FLAG_OF, TISConfig

__all__ = ["check_settings_agree", "config_settings"]

_MASK = (1 << 63) - 1
#: ``(global ranks of the group, digest of the labels, digest of the settings)`` found equal in this process
_AGREED: set[tuple[tuple[int, ...], int, int]] = set()


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


def config_settings(cfg: TISConfig) -> dict[str, Any]:
    """``{"--flag (field)": value}`` of every ``TISConfig`` field, bounds resolved (``upper=None`` and
    ``upper=2.0`` are the same setting)."""
    resolved = {"upper": cfg.upper_bound, "lower": cfg.lower_bound, "eps_clip_high": cfg.eps_high}
    if cfg.rs_level is not None:
        resolved.update(rs_upper=cfg.rs_upper_bound, rs_lower=cfg.rs_lower_bound)
    return {f"{FLAG_OF[f.name]} ({f.name})": resolved.get(f.name, getattr(cfg, f.name))
            for f in dataclasses.fields(cfg)}


def _all_gather(values: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]  # host-sync-ok (once per distinct settings, before the first step)


def check_settings_agree(settings: Mapping[str, Any], *, group: dist.ProcessGroup | None = None,
                         what: str = "slime_tis") -> None:
    """Raise ``ValueError`` on every rank of ``group`` (default: the whole job) unless all hold equal ``settings``
    (compared by ``repr``); every rank of ``group`` calls it at the same point. A no-op without ``torch.distributed``,
    with one rank, or for settings this process already found equal on the same ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    labels = sorted(settings)
    per_label = [_digest(f"{k}={settings[k]!r}") for k in labels]
    summary = [_digest("\n".join(labels)), _digest(",".join(map(str, per_label)))]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    key = (tuple(ranks), *summary)
    if key in _AGREED:
        return
    nccl = str(dist.get_backend(group)).lower() == "nccl"  # NCCL moves CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    table = _all_gather(summary, group, device)
    if all(row == table[0] for row in table):
        _AGREED.add(key)
        return
    me = dist.get_rank()
    if any(row[0] != table[0][0] for row in table):
        groups = _ranks_by_value([row[0] for row in table], ranks)
        raise ValueError(f"{what}: the ranks compare different sets of settings (different slime_tis versions?): "
                         f"ranks {' / '.join(map(str, groups))} each hold one set; this is rank {me}")
    digests = _all_gather(per_label, group, device)
    problems = []
    for i, label in enumerate(labels):
        column = [row[i] for row in digests]
        if len(set(column)) > 1:
            holders = _ranks_by_value(column, ranks)
            problems.append(f"{label}: {settings[label]!r} on this rank (rank {me}); the ranks split into "
                            f"{len(holders)} groups by its value: {' / '.join(map(str, holders))}")
    raise ValueError(f"{what}: the ranks of the job run with different settings; every rank must be started "
                     "with the same flags and configuration:\n  " + "\n  ".join(problems))


def _ranks_by_value(column: list[int], ranks: list[int]) -> list[list[int]]:
    """Global ranks grouped by equal values, in order of first appearance."""
    return [[r for v, r in zip(column, ranks) if v == value] for value in dict.fromkeys(column)]
