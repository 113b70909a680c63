"""Which code computes a kernel's function (``kernels="torch"`` or ``"triton"``), and the fallback to torch.

One choice for every function that has a Triton kernel (the log-probs from logits, the fused output layer,
the correction core's token pass): the ``kernels`` keyword of those functions, set for the whole plugin by
``TISConfig.kernels`` / ``--tis-kernels``.

* ``"torch"`` (the default): the torch code, the reference. triton is never imported.
* ``"triton"``: the Triton kernels, for CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``, the
  tests). Where they cannot run the call computes the same function with the torch code instead, and one
  :class:`KernelFallbackWarning` per kernel and process names the reason:

  - triton does not import, or the tensors are not on CUDA (and no interpreter): the torch code for that call;
  - a kernel fails to compile or launch: that kernel (``"logprobs"``, ``"output_layer"``, ``"correction"``)
    stays on the torch code for the rest of the process (no retry, no second warning). A failure in a
    backward pass falls back inside that backward: training goes on.

Collectives are the same on both paths (the Triton functions issue the torch code's all-reduces), so ranks
that fell back and ranks that did not still match.

The default is ``"torch"`` until the Triton kernels have passed the GPU acceptance run (docs/kernels.md):
they are checked on the CPU under triton's interpreter and compiled for sm_90, never timed on a GPU. Tests
and benchmarks that must run the kernels turn the warning into an error
(``warnings.simplefilter("error", KernelFallbackWarning)``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from collections.abc import Iterator
from types import ModuleType

import torch

__all__ = ["KERNELS", "DEFAULT_KERNELS", "KernelFallbackWarning", "KernelLaunchError", "check_kernels",
           "triton_module", "launching", "fall_back", "torch_only", "reset"]

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


def check_kernels(kernels: object, name: str = "kernels") -> str:
    """``kernels`` if it is one of :data:`KERNELS`, else ``ValueError`` naming the argument and the value."""
    if kernels not in KERNELS:
        raise ValueError(f"{name} must be one of {', '.join(repr(k) for k in KERNELS)}, got {kernels!r}")
    return kernels  # type: ignore[return-value]


def _warn_once(kernel: str, reason: str) -> None:
    if (kernel, reason) in _warned:
        return
    warnings.warn(f"slime_tis: kernels='triton' but the {kernel} kernel cannot run ({reason}); using the torch "
                  "code instead (same function, same collectives)", KernelFallbackWarning, stacklevel=3)
    _warned.add((kernel, reason))  # after warn: an "error" filter raises before this, and the next call retries


def triton_module(kernel: str, module: str, device: torch.device, kernels: str) -> ModuleType | None:
    """The Triton module ``module`` (e.g. ``"slime_tis.kernels.logprobs"``) when ``kernel`` should run on
    ``device`` with this ``kernels`` choice, else ``None`` (the caller runs the torch code; warned once)."""
    if check_kernels(kernels) == "torch":
        return None
    if kernel in _disabled:
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


def reset() -> None:
    """Forget every fallback and warning of this process (tests)."""
    _disabled.clear()
    _warned.clear()
