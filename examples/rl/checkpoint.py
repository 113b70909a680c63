"""Training checkpoints in megatron-core's ``dist_checkpointing`` format (sharded, layout-independent).

Layout of ``RUN_DIR/checkpoints``::

    step_{N:06d}/            megatron dist checkpoint (torch_dist): the model's and the optimizer's sharded
                             state dicts, as global tensors keyed by megatron's sharded keys
    step_{N:06d}/extra.pt    rollout-lag history (full GPT-2-layout weights; written by the engine rank)
    step_{N:06d}/manifest.sha256   sha256 of every file of the step (``examples.rl.ckpt_manifest``), written
                             by rank 0 once the step is complete; verified before any load
    latest                   the step number, written last by rank 0 after a barrier (an interrupted save
                             is never picked up)

A run directory must be trusted: torch's checkpoint reader unpickles ``.metadata``. The manifest detects
corruption (a flipped byte, a truncated copy), not tampering.

Each rank contributes its own pipeline stage / data-parallel replica (``model.sharded_state_dict()`` and
``optimizer.sharded_state_dict(...)``: tensors carry their global offsets and replica ids), so a run saved
at one layout resumes at another (PP=2 -> DP=2 or PP=1; tested in torchrun). Prompts and sampling seeds are
derived from ``(seed, step)``, so no RNG state is needed. Tensor parallelism is not used by the example.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from examples.rl.ckpt_manifest import CheckpointIntegrityError, verify_manifest, write_manifest

EXTRA_FILE = "extra.pt"


class UnsupportedTorchError(RuntimeError):
    """The installed torch cannot run the example (message names the version and the fix)."""


def check_reader_compatible() -> None:
    """Refuse, at argument parsing, a torch whose checkpoint metadata megatron-core cannot read back.

    megatron-core's ``dist_checkpointing`` (0.16-0.19) rebuilds each saved tensor as
    ``torch.empty(size, **TensorProperties.__dict__)``; torch 2.15 added a ``strides`` field to
    ``TensorProperties`` that ``torch.empty`` does not take, so every ``--resume`` (and every load) would fail
    after the run had trained and saved. The check performs exactly that call on default properties.
    """
    from torch.distributed.checkpoint.metadata import TensorProperties

    try:
        torch.empty(1, **TensorProperties().__dict__, device="meta")
    except TypeError as err:
        raise UnsupportedTorchError(
            f"torch {torch.__version__}: megatron-core's dist_checkpointing cannot read checkpoints back with this "
            f"torch (it passes TensorProperties fields {sorted(TensorProperties().__dict__)} to torch.empty: {err}). "
            "The example needs torch < 2.15 (docs/testing.md), e.g. pip install 'torch==2.13.0'") from None


def _dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def sharded_state(model: torch.nn.Module, optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}``: megatron sharded state dicts of this rank's part."""
    model_sd = _unwrap(model).sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def save(
    run_dir: str,
    step: int,
    model: torch.nn.Module,
    optimizer: Any,
    layout: dict[str, int],
    extra: dict[str, Any] | None = None,
) -> str:
    """Save the state after ``step`` completed steps (collective: every rank must call).

    ``extra`` (the lag history) is written by the rank that passes it (the engine rank); ``layout`` is
    recorded for information only (any layout may load the checkpoint)."""
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    path = _dir(run_dir, step)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    state = sharded_state(model, optimizer, is_loading=False)
    state["saved_layout"] = dict(layout)
    dist_checkpointing.save(state, path)
    if extra is not None:
        tmp = os.path.join(path, EXTRA_FILE + ".tmp")
        torch.save(extra, tmp)
        os.replace(tmp, os.path.join(path, EXTRA_FILE))
    torch.distributed.barrier()
    if rank == 0:
        write_manifest(path)  # every file of the step is complete (barrier above)
        ckpt = os.path.join(run_dir, "checkpoints")
        with open(os.path.join(ckpt, "latest.tmp"), "w", encoding="utf-8") as f:
            f.write(str(step))
        os.replace(os.path.join(ckpt, "latest.tmp"), os.path.join(ckpt, "latest"))
    torch.distributed.barrier()
    return path


def latest_step(run_dir: str) -> int | None:
    """The step of the last complete checkpoint in ``run_dir``, or None when ``checkpoints/latest`` does not
    exist. A ``latest`` that does not hold a step number (>= 1) is a :class:`CheckpointIntegrityError` naming it."""
    path = os.path.join(run_dir, "checkpoints", "latest")
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointIntegrityError(f"{path} cannot be read ({e.strerror})") from None
    text = raw.decode("utf-8", "replace").strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 12 and int(text) >= 1):
        raise CheckpointIntegrityError(
            f"{path} holds {text[:40]!r}, not the step number of a checkpoint (the trainer writes e.g. '4'): "
            "the file is damaged; write the step of a complete checkpoints/step_N directory into it"
        )
    return int(text)


def check_complete(run_dir: str, step: int) -> str:
    """The directory of the checkpoint of ``step``, after checking that it is one (``metadata.json``) and that
    every file matches its manifest; :class:`CheckpointIntegrityError` naming the file otherwise. Read-only:
    every rank may call it before anything is built."""
    path = _dir(run_dir, step)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointIntegrityError(f"no dist checkpoint at {path} (metadata.json missing)")
    verify_manifest(path)  # before torch's reader opens (and unpickles) anything
    return path


def load(run_dir: str, step: int, model: torch.nn.Module, optimizer: Any, *, load_extra: bool) -> dict[str, Any]:
    """Restore model and optimizer saved at ``step`` into this rank's part of the current layout (collective);
    returns the ``extra`` dict when ``load_extra`` (the engine rank), else ``{}``."""
    from megatron.core import dist_checkpointing

    path = check_complete(run_dir, step)  # again: the files may have changed since the run started
    loaded = dist_checkpointing.load(sharded_state(model, optimizer, is_loading=True), path)
    _unwrap(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    if not load_extra:
        return {}
    extra_path = os.path.join(path, EXTRA_FILE)
    if not os.path.exists(extra_path):
        raise FileNotFoundError(f"checkpoint {path} has no {EXTRA_FILE} (rollout-lag history)")
    return torch.load(extra_path, map_location="cpu", weights_only=True)


def load_model(run_dir: str, step: int, model: torch.nn.Module) -> None:
    """Restore only the model weights saved at ``step`` (any layout; the optimizer state is not read)."""
    from megatron.core import dist_checkpointing

    path = check_complete(run_dir, step)
    loaded = dist_checkpointing.load({"model": _unwrap(model).sharded_state_dict()}, path)
    _unwrap(model).load_state_dict(loaded["model"])
