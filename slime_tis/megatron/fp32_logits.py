"""Float32 logits of a half-precision LM head without a float32 copy of the weight (``--tis-fp32-lm-head``).

For ``x [..., H]`` and ``W [V, H]`` in bf16 (or fp16):

    z = x W^T          float32 output, float32 accumulation                          [..., V]

Every product of two bf16 numbers is exact in float32 (8 + 8 significant bits < 24), so ``z`` equals the
float32 GEMM of the upcast operands, ``F.linear(x.float(), W.float())``, up to the order of the float32
summation over ``H``: the same values, from the tensor-core GEMM with float32 output
(``torch.mm(a, b, out_dtype=torch.float32)``, CUDA) and without the ``[V, H]`` float32 weight copy.

Backward, with the float32 upstream gradient ``g = dL/dz [T, V]``: ``g`` is split exactly into three bf16
parts ``g = g1 + g2 + g3`` (``g1 = bf16(g)``, ``g2 = bf16(g - g1)``, ``g3 = g - g1 - g2``: 3 x 8 significant
bits cover float32's 24, each difference is exact in float32), so every product ``g_k * W`` is again exact
and

    dL/dx = sum_k g_k W          float32 accumulation, returned in x's dtype          [..., H]
    dL/dW = sum_k g_k^T x        float32 accumulation, returned in W's dtype          [V, H]

equal today's float32 GEMMs of the upcast operands up to float32 summation order (three bf16 tensor-core
GEMMs instead of one float32 GEMM, which without TF32 runs on the CUDA cores at about 1/15 of the rate).
The backward walks the vocabulary in chunks of ``chunk_size`` rows of ``W``: the split parts of one chunk
(``6 * T * chunk_size`` bytes) are its only temporaries besides the float32 ``dL/dx`` accumulator.

Where ``torch.mm(..., out_dtype=torch.float32)`` has no kernel (CPU in torch 2.13: only CUDA and meta
have one) the same code multiplies float32 upcasts of the operands chunk by chunk (exact upcasts, so the
same values; the weight is upcast ``chunk_size`` rows at a time, never whole).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["fp32_logits", "mm_float32", "split_bf16"]

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _has_mm_out_dtype(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for bf16 operands on this device type."""
    try:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (NotImplementedError, RuntimeError, TypeError):
        return False


def mm_float32(a: Tensor, b: Tensor) -> Tensor:
    """``a [M, K] @ b [K, N]`` with float32 accumulation and a float32 result.

    Same half dtype on both sides and a device with the kernel: one ``torch.mm(..., out_dtype=float32)``
    (no operand copy). Otherwise the float32 GEMM of the (exactly) upcast operands."""
    if a.dtype == b.dtype and a.dtype in _HALF and _has_mm_out_dtype(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def split_bf16(g: Tensor, dtype: torch.dtype) -> list[Tensor]:
    """``g`` (float32) as half-precision parts whose float32 sum is ``g`` exactly (three for bf16, whose
    8 significant bits x 3 cover float32's 24); ``[g]`` when ``g`` already has ``dtype``.

    fp16 (11 significant bits, narrower exponent range) uses the same three-way split: 33 bits >= 24, but a
    part may underflow or overflow fp16's range, so fp16 is exact only for gradients within it."""
    if g.dtype == dtype:
        return [g]
    parts = []
    rest = g.float()
    for k in range(3):
        part = rest.to(dtype)
        parts.append(part)
        if k < 2:
            rest = rest - part.float()  # exact: part is rest rounded to fewer bits
    return parts


class _Fp32Logits(torch.autograd.Function):
    """``(x [T, H], W [V, H]) -> z = x W^T [T, V]`` float32 (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, chunk_size: int) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.chunk_size = chunk_size
        if x.dtype == weight.dtype and x.dtype in _HALF and _has_mm_out_dtype(x.device.type):
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        xf = x.float()
        for lo in range(0, weight.shape[0], chunk_size):
            hi = min(lo + chunk_size, weight.shape[0])
            torch.mm(xf, weight[lo:hi].float().t(), out=out[:, lo:hi])
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        for lo in range(0, weight.shape[0], chunk_size):
            hi = min(lo + chunk_size, weight.shape[0])
            parts = split_bf16(grad[:, lo:hi], weight.dtype)
            if need_x:
                for part in parts:
                    grad_x.add_(mm_float32(part, weight[lo:hi]))
            if need_w:
                acc = mm_float32(parts[0].t(), x)
                for part in parts[1:]:
                    acc.add_(mm_float32(part.t(), x))
                grad_w[lo:hi].copy_(acc)
            del parts
        return (grad_x.to(x.dtype) if need_x else None), grad_w, None


def fp32_logits(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, chunk_size: int = 4096) -> Tensor:
    """``F.linear(x, weight, bias)`` with float32 output and float32 accumulation (module docstring).

    Args:
        x: ``[..., H]`` (bf16 under bf16 training).
        weight: ``[V, H]`` (the output layer's vocabulary shard).
        bias: optional ``[V]``, added in float32.
        chunk_size: rows of ``weight`` per backward step (and per forward step without the float32-output
            GEMM); bounds the temporaries.

    Returns:
        ``[..., V]`` float32, differentiable in ``x``, ``weight`` and ``bias`` (gradients in their dtypes).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must end with the hidden size of weight {tuple(weight.shape)}")
    lead = x.shape[:-1]
    z = _Fp32Logits.apply(x.reshape(-1, x.shape[-1]), weight, chunk_size).view(*lead, weight.shape[0])
    if bias is not None:
        z = z + bias.float()
    return z
