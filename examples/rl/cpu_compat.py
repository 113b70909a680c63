"""CPU compatibility layer for running megatron-core 0.16.x - 0.19.x on a CPU-only torch build (gloo backend).

The one such module of the repository: the example job (:func:`enable` in ``examples/rl/dist.py``) and the
test suite (``tests/_cpu/cpu_shim.py`` only calls into it) share it. megatron-core assumes CUDA in a handful
of places; :func:`enable` patches exactly those places and is a no-op when CUDA is available, so GPU runs
execute megatron-core unmodified (``force=True`` patches anyway: the gloo tests keep their tensors on the CPU
even on a GPU machine).

What is redirected (when CUDA is absent, or with ``force``):

* ``torch.cuda.current_device()`` -> ``cpu`` (buffer allocations in attention, P2P, DDP);
* ``torch.cuda.synchronize`` / streams / events -> no-ops;
* the CUDA RNG state used by ``model_parallel_cuda_manual_seed`` and the RNG tracker -> the CPU RNG;
* a ``TorchFunctionMode`` that maps literal ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` to CPU,
  turns ``pin_memory`` off and reports ``Tensor.type()`` as ``torch.cuda.*`` (megatron asserts it in
  grad clipping);
* when ``triton`` is not installed, a placeholder for the one megatron module that imports a triton kernel
  unconditionally (``megatron.core.transformer.moe.ops.paged_stash`` in 0.19.x; calling it raises). Never a
  fake ``triton``: torch._inductor would then believe triton exists.

:func:`patch_runtime` applies everything except the ``TorchFunctionMode`` (for code that only needs the CUDA
runtime calls answered); :func:`enable` applies both.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_enabled = False
_patched = False
_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


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


def _register_triton_free_placeholder() -> None:
    """Without triton, stand in for megatron's paged-stash kernel module (see module docstring)."""
    if importlib.util.find_spec("triton") is not None or _PAGED_STASH in sys.modules:
        return

    def _unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("megatron's paged_stash triton kernel is unavailable without triton")

    class _Kernel:
        """Supports ``kernel[grid](...)`` and ``kernel(...)``; both raise."""

        def __getitem__(self, grid: Any) -> Any:
            return _unavailable

        __call__ = staticmethod(_unavailable)

    m = types.ModuleType(_PAGED_STASH)
    m.GLOBAL_BLOCK_SIZE = 1024
    m.paged_stash_copy_kernel = _Kernel()
    m.paged_stash_pop_kernel = _Kernel()
    m.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH] = m


def patch_runtime(*, force: bool = False) -> bool:
    """Answer the CUDA runtime calls megatron-core makes (device, sync, streams, events, RNG) on the CPU.
    Idempotent; a no-op with CUDA present unless ``force``. Returns True if the patches are active."""
    global _patched
    if _patched:
        return True
    if torch.cuda.is_available() and not force:
        return False
    _register_triton_free_placeholder()
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
    _patched = True
    return True


def enable(*, force: bool = False) -> bool:
    """:func:`patch_runtime` plus the CUDA-to-CPU ``TorchFunctionMode`` for the rest of the process.
    Idempotent; a no-op with CUDA present unless ``force``. Returns True if the redirections are active."""
    global _enabled
    if _enabled:
        return True
    if not patch_runtime(force=force):
        return False
    _CudaToCpuMode().__enter__()
    _enabled = True
    return True
