"""Per-rank training checkpoints: model, optimizer and rollout-lag history, for bit-identical resume.

Layout: ``RUN_DIR/checkpoints/step_{N:06d}/rank_{r:03d}.pt`` plus ``RUN_DIR/checkpoints/latest`` (the
step number, written last by rank 0 after a barrier, so an interrupted save is never picked up).
Each rank stores its own pipeline stage / data-parallel replica, so a resume must use the same
``--pp`` and world size (checked). Prompts and sampling seeds are derived from ``(seed, step)``,
so no RNG state is needed.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def save(
    run_dir: str,
    step: int,
    model: torch.nn.Module,
    optimizer: Any,
    layout: dict[str, int],
    extra: dict[str, Any] | None = None,
) -> str:
    """Save this rank's state after ``step`` completed steps (collective: every rank must call)."""
    rank = torch.distributed.get_rank()
    path = _dir(run_dir, step)
    os.makedirs(path, exist_ok=True)
    state = {
        "step": step,
        "layout": layout,
        "model": _unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "extra": extra or {},
    }
    tmp = os.path.join(path, f"rank_{rank:03d}.pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(path, f"rank_{rank:03d}.pt"))
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(run_dir, "checkpoints", "latest.tmp"), "w", encoding="utf-8") as f:
            f.write(str(step))
        os.replace(os.path.join(run_dir, "checkpoints", "latest.tmp"), os.path.join(run_dir, "checkpoints", "latest"))
    torch.distributed.barrier()
    return path


def latest_step(run_dir: str) -> int | None:
    """The step of the last complete checkpoint in ``run_dir``, or None."""
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest"), encoding="utf-8") as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None


def load(run_dir: str, step: int, model: torch.nn.Module, optimizer: Any, layout: dict[str, int]) -> dict[str, Any]:
    """Restore this rank's state saved at ``step``; returns the ``extra`` dict."""
    rank = torch.distributed.get_rank()
    path = os.path.join(_dir(run_dir, step), f"rank_{rank:03d}.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint for rank {rank} at {path}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["layout"] != layout:
        raise ValueError(
            f"checkpoint layout {state['layout']} does not match this run's {layout}; "
            "resume with the same --pp and number of processes"
        )
    _unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["extra"]
