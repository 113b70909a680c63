"""``--tis-fp32-lm-head``: float32 logits from the bf16 operands, no float32 copy of the weight.

Reference ("today's path"): ``F.linear(x.float(), W.float())`` with autograd, the float32 GEMM of the upcast
operands whose backward returns the float32 gradients rounded to the operands' dtype. Oracle: float64.

Tolerances. Every product of two bf16 numbers (and of a bf16 part of the split gradient with a bf16 number) is
exact in float32, so both paths are float32 sums of the same exact products and differ only in summation order:
each is within ``n * 2^-24 * sum|products|`` of the exact sum over ``n`` terms (the bound computed per element;
``n`` = H for the logits, V for dL/dx, T for dL/dW). The gradients come back in bf16, rounded once more
(2^-9 relative each). Measured here: the logits are bit-identical, 1 of ~3.5k / ~19.5k gradient elements
differ (by one bf16 step, where the float32 sums straddle a rounding boundary).

The "no weight copy" check runs the output layer's fp32 forward and backward on the ``meta`` device, which
has the ``torch.mm(..., out_dtype=torch.float32)`` kernel that CUDA has (CPU has none), at the real sizes
(152k x 4096 weight) under a dispatch mode that records every op: no float32 tensor as large as the weight
may be produced and every matmul must be the bf16-operand, float32-output one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from slime_tis.megatron.fp32_logits import fp32_logits, split_bf16
from slime_tis.megatron.output_layer import _fp32_forward

EPS32 = 2.0 ** -24


def _data(t=37, h=96, v=203, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * scale).bfloat16()
    w = (torch.randn(v, h, generator=g) * 0.1).bfloat16()
    up = torch.randn(t, v, generator=g)  # float32 upstream gradient dL/dz, full 24-bit mantissas
    return x, w, up


def _today(x, w, up):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    z = F.linear(x.float(), w.float())
    z.backward(up)
    return z.detach(), x.grad, w.grad


def _new(x, w, up, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    z = fp32_logits(x, w, **kw)
    z.backward(up)
    return z.detach(), x.grad, w.grad


def _bounds(x, w, up):
    """Per-element float32 summation bounds n * eps * sum|products| of z, dL/dx, dL/dW (float64)."""
    xa, wa, ua = x.double().abs(), w.double().abs(), up.double().abs()
    return (x.shape[1] * EPS32 * xa @ wa.t(), w.shape[0] * EPS32 * ua @ wa, x.shape[0] * EPS32 * ua.t() @ xa)


def _same_up_to_rounding(a: torch.Tensor, b: torch.Tensor, bound: torch.Tensor) -> bool:
    """bf16 results of two float32 sums that differ by at most ``2 * bound`` (each within ``bound`` of the exact
    value): apart by at most that plus one bf16 rounding step of each (2^-9 relative each, so 2^-8)."""
    a, b = a.double(), b.double()
    return bool(((a - b).abs() <= 2 * bound + 2.0 ** -8 * torch.maximum(a.abs(), b.abs())).all())


@pytest.mark.parametrize("chunk_size", [4096, 64, 7])
def test_values_and_gradients_equal_todays_float32_path(chunk_size):
    x, w, up = _data()
    z0, gx0, gw0 = _today(x, w, up)
    z1, gx1, gw1 = _new(x, w, up, chunk_size=chunk_size)
    bz, bgx, bgw = _bounds(x, w, up)
    assert z1.dtype == torch.float32 and gx1.dtype == torch.bfloat16 and gw1.dtype == torch.bfloat16
    assert ((z1.double() - z0.double()).abs() <= 2 * bz).all()
    assert _same_up_to_rounding(gx1, gx0, bgx) and _same_up_to_rounding(gw1, gw0, bgw)
    # and both within the summation bound of the float64 result (before the final bf16 rounding of grads)
    zx = x.double() @ w.double().t()
    assert ((z1.double() - zx).abs() <= bz).all()
    gx64, gw64 = up.double() @ w.double(), up.double().t() @ x.double()
    assert ((gx1.double() - gx64).abs() <= bgx + 2.0 ** -8 * gx64.abs()).all()
    assert ((gw1.double() - gw64).abs() <= bgw + 2.0 ** -8 * gw64.abs()).all()


def test_split_of_a_float32_gradient_into_bf16_parts_is_exact():
    g = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * torch.logspace(-30, 30, 1000)
    parts = split_bf16(g, torch.bfloat16)
    assert len(parts) == 3 and all(p.dtype == torch.bfloat16 for p in parts)
    total = parts[0].double() + parts[1].double() + parts[2].double()
    assert torch.equal(total, g.double())
    half = g.bfloat16()
    assert len(split_bf16(half, torch.bfloat16)) == 1 and split_bf16(half, torch.bfloat16)[0] is half


def test_bias_leading_dims_and_bad_arguments():
    x, w, _ = _data(t=12)
    b = torch.randn(w.shape[0]).bfloat16()
    z = fp32_logits(x.view(3, 4, -1), w, b)
    assert z.shape == (3, 4, w.shape[0]) and z.dtype == torch.float32
    ref = F.linear(x.float(), w.float(), b.float()).view(3, 4, -1)
    assert torch.allclose(z, ref, rtol=0, atol=float(2 * _bounds(x, w, torch.zeros(12, w.shape[0]))[0].max()) + 1e-7)
    with pytest.raises(ValueError, match="chunk_size"):
        fp32_logits(x, w, chunk_size=0)
    with pytest.raises(ValueError, match="hidden size"):
        fp32_logits(x, w[:, :5])


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [(a.dtype, tuple(a.shape)) for a in args if isinstance(a, torch.Tensor)]
        outs = [(o.dtype, o.numel()) for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor)]
        self.ops.append((str(func), ins, outs))
        return out


def test_output_layer_fp32_head_makes_no_float32_weight_copy_at_real_size():
    """The megatron output layer's fp32 forward + backward at 152064 x 4096 (meta device: the CUDA kernels'
    shapes and dtypes, no memory): no float32 tensor the size of the weight, only bf16 x bf16 -> float32 GEMMs."""
    t, h, v = 512, 4096, 152064
    w = torch.empty(v, h, dtype=torch.bfloat16, device="meta", requires_grad=True)
    layer = SimpleNamespace(weight=w, bias=None, skip_bias_add=False, gather_output=False, tp_group=None,
                            sequence_parallel=False)
    x = torch.empty(t, 1, h, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with _Record() as rec:
        logits, _ = _fp32_forward(layer, x)
        logits.backward(torch.empty_like(logits))
    assert logits.dtype == torch.float32 and logits.shape == (t, 1, v)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    big_fp32 = [(op, outs) for op, _, outs in rec.ops
                for dt, n in outs if dt == torch.float32 and n >= v * h // 2]
    assert not big_fp32, f"float32 tensors of weight size: {big_fp32[:3]}"
    mms = [(op, ins) for op, ins, _ in rec.ops if "mm" in op or "linear" in op or "addmm" in op]
    assert mms, rec.ops
    assert all(op.startswith("aten.mm.dtype") and all(dt == torch.bfloat16 for dt, _ in ins) for op, ins in mms), mms
