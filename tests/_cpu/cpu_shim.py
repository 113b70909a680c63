"""Test-only monkeypatches that let megatron-core 0.16.x run on a CPU-only torch build with gloo.

Import before megatron model/schedule code runs; call ``enable_cuda_to_cpu_mode()`` for pipeline
schedules, DDP and optimizers (they use literal ``device="cuda"`` and check ``Tensor.type()``).
See /work/shared/notes_megatron_cpu.md section 2 for the list of obstacles each patch removes.
Never imported by the ``slime_tis`` package.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from . import triton_free  # noqa: F401

_CPU = torch.device("cpu")

# (1) allocations on torch.cuda.current_device() (attention buffers, TP mappings, P2P, DDP buffers)
torch.cuda.current_device = lambda: _CPU
# (2) synchronisation, streams and events
torch.cuda.synchronize = lambda *a, **k: None


class _FakeEvent:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, *a, **k) -> None:
        pass

    def wait(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _FakeStream:
    def __init__(self, *a, **k) -> None:
        pass

    def wait_event(self, *a, **k) -> None:
        pass

    def wait_stream(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or _FakeEvent()


_STREAM = _FakeStream()
torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: _STREAM
torch.cuda.Stream, torch.cuda.Event = _FakeStream, _FakeEvent
torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

# (3) CUDA RNG -> CPU RNG (model_parallel_cuda_manual_seed, RNG-tracker fork() around attention dropout)
torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)

import megatron.core.tensor_parallel.random as _mrandom  # noqa: E402

_mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
_mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _to_cpu(device):
    if (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda"
    ):
        return _CPU
    return device


class CudaToCpu(TorchFunctionMode):
    """(4) literal ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` go to the CPU; ``pin_memory`` off;
    ``Tensor.type()`` reports ``torch.cuda.*`` (megatron asserts it in clip_grads / DistributedOptimizer)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


_mode: CudaToCpu | None = None


def enable_cuda_to_cpu_mode() -> None:
    """Enter the ``CudaToCpu`` mode for the rest of the process (idempotent)."""
    global _mode
    if _mode is None:
        _mode = CudaToCpu()
        _mode.__enter__()
