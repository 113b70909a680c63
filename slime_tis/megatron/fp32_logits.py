"""``fp32_logits(x, W)``: ``z = x W^T`` [..., V] float32, float32 accumulation, from bf16 / fp16 operands without a
float32 copy of ``W`` (``--tis-fp32-lm-head``). Equal to ``F.linear(x.float(), W.float())`` up to float32
summation order; the backward splits ``dL/dz`` exactly into three half-precision parts so that every GEMM product
is exact (derivation: docs/output_layer.md, "Float32 LM head for the unfused path").
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.kernels.output_layer import CHUNK_COLUMNS, HALF, has_mm_out_dtype, mm_f32

__all__ = ["fp32_logits", "split_bf16"]


def split_bf16(g: Tensor, dtype: torch.dtype) -> list[Tensor]:
    """``g`` (float32) as three ``dtype`` parts whose float32 sum is ``g`` (exact for bf16; for fp16 only within
    its range); ``[g]`` when ``g`` already has ``dtype``."""
    if g.dtype == dtype:
        return [g]
    parts = []
    rest = g.float()
    for _ in range(3):
        parts.append(rest.to(dtype))
        rest = rest - parts[-1].float()  # exact: the part is rest rounded to fewer bits
    return parts


class _Fp32Logits(torch.autograd.Function):
    """``(x [T, H], W [V, H]) -> x W^T [T, V]`` float32; the backward walks ``W`` in chunks of ``chunk_size``
    rows."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, chunk_size: int) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.chunk_size = chunk_size
        if x.dtype == weight.dtype and x.dtype in HALF and has_mm_out_dtype(x.device.type):
            return mm_f32(x, weight.t())
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
                    grad_x.add_(mm_f32(part, weight[lo:hi]))
            if need_w:
                acc = mm_f32(parts[0].t(), x)
                for part in parts[1:]:
                    acc.add_(mm_f32(part.t(), x))
                grad_w[lo:hi].copy_(acc)
            del parts
        return (grad_x.to(x.dtype) if need_x else None), grad_w, None


def fp32_logits(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, chunk_size: int = CHUNK_COLUMNS) -> Tensor:
    """``F.linear(x, weight, bias)`` as float32: ``x [..., H]``, ``weight [V, H]``, ``bias [V]`` (added in float32)
    -> ``[..., V]`` float32, gradients in the inputs' dtypes. ``chunk_size``: rows of ``weight`` per step."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must end with the hidden size of weight {tuple(weight.shape)}")
    lead = x.shape[:-1]
    z = _Fp32Logits.apply(x.reshape(-1, x.shape[-1]), weight, chunk_size).view(*lead, weight.shape[0])
    if bias is not None:
        z = z + bias.float()
    return z
