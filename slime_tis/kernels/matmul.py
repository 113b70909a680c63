"""Float32 products of bf16 / fp16 matrices: float32 accumulation and output, exact products. On CUDA one
tensor-core GEMM with ``out_dtype=float32`` (no float32 copies, no TF32); elsewhere the operands are upcast first.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mm_f32", "addmm_f32_"]

_NO_OUT_DTYPE: set[str] = set()  # device types whose torch.mm has no float32 out_dtype for half inputs


def _native(a: Tensor) -> bool:
    return a.dtype in (torch.bfloat16, torch.float16) and a.device.type not in _NO_OUT_DTYPE \
        and a.device.type == "cuda"


def mm_f32(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a [M, K] @ b [K, N]`` as float32 ``[M, N]`` (into ``out`` when given); ``a``, ``b`` of one dtype."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if _native(a):
        try:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (TypeError, NotImplementedError):  # torch without out_dtype (TypeError) or without the kernel
            _NO_OUT_DTYPE.add(a.device.type)
    return torch.mm(a.float(), b.float(), out=out)


def addmm_f32_(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``acc += a @ b`` in float32 (``acc`` float32 ``[M, N]``); returns ``acc``.

    CUDA with bf16 / fp16 operands: the float32 product is formed by :func:`mm_f32` and added (torch's
    ``addmm`` cannot add a float32 ``acc`` to a half-precision product); elsewhere ``acc.addmm_`` in float32.
    """
    if a.dtype != torch.float32 and _native(a):
        return acc.add_(mm_f32(a, b))
    if a.dtype != torch.float32:
        a, b = a.float(), b.float()
    return acc.addmm_(a, b)
