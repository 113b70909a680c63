"""CPU compatibility layer for running megatron-core 0.16.x on a CPU-only torch build (gloo backend).

The example job defaults to an embedded CPU run; megatron-core assumes CUDA in a handful of places
(see ``shared/notes_megatron_cpu.md`` section 2). :func:`enable` patches exactly those places and is a
no-op when CUDA is available, so GPU runs execute megatron-core unmodified.

What is redirected (only when ``torch.cuda.is_available()`` is False):

* ``torch.cuda.current_device()`` -> ``cpu`` (buffer allocations in attention, P2P, DDP);
* ``torch.cuda.synchronize`` / streams / events -> no-ops;
* the CUDA RNG state used by ``model_parallel_cuda_manual_seed`` and the RNG tracker -> the CPU RNG;
* a ``TorchFunctionMode`` that maps literal ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` to CPU,
  turns ``pin_memory`` off and reports ``Tensor.type()`` as ``torch.cuda.*`` (megatron asserts it in
  grad clipping).

This module is part of the example (user-facing); the test suite has its own, independent shim.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_enabled = False


class _NullEvent:
    """Stand-in for ``torch.cuda.Event`` on CPU: every operation completes immediately."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU (CPU work is already ordered)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: _NullEvent | None = None) -> _NullEvent:
        return event or _NullEvent()


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests inside megatron-core to CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def enable() -> bool:
    """Install the CPU redirections if CUDA is absent. Idempotent. Returns True if they are active."""
    global _enabled
    if _enabled:
        return True
    if torch.cuda.is_available():
        return False
    stream = _NullStream()
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.default_stream = lambda *a, **k: stream
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)

    import megatron.core.tensor_parallel.random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    _CudaToCpuMode().__enter__()
    _enabled = True
    return True


def is_enabled() -> bool:
    return _enabled
