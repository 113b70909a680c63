"""Test entry point of the repository's one CPU-compatibility module for megatron-core,
:mod:`examples.rl.cpu_compat` (shared with the example job; no logic lives here).

Importing this module answers megatron's CUDA runtime calls on the CPU (``cpu_compat.patch_runtime``);
``enable_cuda_to_cpu_mode()`` also enters the CUDA-to-CPU ``TorchFunctionMode`` (pipeline schedules, DDP and
optimizers use literal ``device="cuda"`` and check ``Tensor.type()``). Both are forced: the gloo tests keep
their tensors on the CPU even on a machine with a GPU. Never imported by the ``slime_tis`` package.
"""

from __future__ import annotations

from examples.rl import cpu_compat

cpu_compat.patch_runtime(force=True)


def enable_cuda_to_cpu_mode() -> None:
    """Enter the CUDA-to-CPU mode for the rest of the process (idempotent)."""
    cpu_compat.enable(force=True)
