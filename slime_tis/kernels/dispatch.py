"""Which code computes a kernel's function (``kernels="torch"`` or ``"triton"``, ``--tis-kernels``), and the
fallback to torch: where the Triton code cannot run (no triton, no CUDA tensors without ``TRITON_INTERPRET=1``) the
torch code runs with one :class:`KernelFallbackWarning` per kernel and reason; a failed compile or launch keeps that
kernel on torch for the process. Both paths issue the same collectives. docs/kernels.md, "Choosing the code".
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.distributed as dist

__all__ = ["KERNELS", "DEFAULT_KERNELS", "KernelFallbackWarning", "KernelLaunchError", "check_kernels",
           "triton_module", "launching", "fall_back", "torch_only", "check_args", "group_size"]

KERNELS = ("torch", "triton")
DEFAULT_KERNELS = "torch"  # until the Triton kernels pass on a GPU (docs/kernels.md)

_disabled: dict[str, str] = {}  # kernel -> the error that switched it to torch for this process
_warned: set[tuple[str, str]] = set()


class KernelFallbackWarning(UserWarning):
    """``kernels="triton"`` asked for, the torch code ran instead (the message says why)."""


class KernelLaunchError(RuntimeError):
    """A Triton kernel failed to compile or launch (raised by :func:`launching`, handled by the fallback)."""

    def __init__(self, kernel: str, error: BaseException):
        super().__init__(f"{kernel}: {type(error).__name__}: {error}")
        self.kernel, self.error = kernel, error


def check_kernels(kernels: object) -> str:
    """``kernels`` if it is one of :data:`KERNELS`, else ``ValueError`` naming the argument and the value."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(repr(k) for k in KERNELS)}, got {kernels!r}")
    return kernels  # type: ignore[return-value]


def check_args(temperature: object, chunk_size: object) -> float:
    """``float(temperature)``; ``ValueError`` unless it is a number > 0 and ``chunk_size`` an int >= 1."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    return float(temperature)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks of ``group`` (1 for ``None`` or without ``torch.distributed``)."""
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _warn_once(kernel: str, reason: str) -> None:
    if (kernel, reason) in _warned:
        return
    warnings.warn(f"slime_tis: kernels='triton' but the {kernel} kernel cannot run ({reason}); using the torch "
                  "code instead (same function, same collectives)", KernelFallbackWarning, stacklevel=3)
    _warned.add((kernel, reason))  # after warn: an "error" filter raises before this, and the next call retries


def triton_module(kernel: str, module: str, device: torch.device, kernels: str) -> ModuleType | None:
    """The Triton module ``module`` (e.g. ``"slime_tis.kernels.logprobs"``) when ``kernel`` should run on
    ``device`` with this ``kernels`` choice, else ``None`` (the caller runs the torch code; warned once)."""
    if check_kernels(kernels) == "torch" or kernel in _disabled:
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        _warn_once(kernel, f"tensors on {device.type}: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 "
                           "set before triton is imported")
        return None
    try:
        return importlib.import_module(module)
    except ImportError as err:
        _warn_once(kernel, f"triton is not importable: {type(err).__name__}: {err}; pip install triton")
        return None


def torch_only(kernel: str, kernels: str, reason: str) -> None:
    """A call ``kernel``'s Triton code does not cover (``reason``): with ``kernels="triton"`` one warning, and the
    caller runs the torch code (the same collectives)."""
    if check_kernels(kernels) == "triton":
        _warn_once(kernel, reason)


def fall_back(err: KernelLaunchError) -> None:
    """Record a compile / launch failure: one warning naming it, and its kernel stays on torch from now on."""
    _warn_once(err.kernel, f"compile or launch failed: {type(err.error).__name__}: {err.error}")
    _disabled[err.kernel] = str(err)


@contextlib.contextmanager
def launching(kernel: str) -> Iterator[None]:
    """Wrap the launch of ``kernel``'s Triton code: any error (compilation, resources, driver) becomes a
    :class:`KernelLaunchError` for the caller's fallback. Wrap launches only, never a collective."""
    try:
        yield
    except KernelLaunchError:
        raise
    except Exception as err:  # noqa: BLE001 -- any compiler / driver error: the caller falls back to torch
        raise KernelLaunchError(kernel, err) from err
