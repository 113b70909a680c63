"""Triton kernel of the correction core's token pass and per-sequence sums; the torch code in
``slime_tis.core.ratios.packed_ratios`` is the reference. One program per sequence ``i`` (``v`` = valid)::

    l_t        = v ? (extra values finite ? lp_train - lp_rollout : NaN) : 0     [T] float32
    sums[i, :] = (sum l, sum_{valid} lp_rollout, n_valid)                       [n_seq, 3] float64

NaN reaches the sums by selection only (docs/kernels.md, "Non-finite values"); no atomics, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from slime_tis.kernels.dispatch import launching

__all__ = ["sequence_sums", "MAX_EXTRA"]

MAX_EXTRA = 2


@triton.jit
def _nan_unless_finite(value, x):
    """``value`` where ``x`` is finite, else NaN (``|NaN| < inf`` is false)."""
    return tl.where(tl.abs(x) < float("inf"), value, float("nan"))


@triton.jit
def _sequence_sums_kernel(lt_ptr, lr_ptr, valid_ptr, e0_ptr, e1_ptr, cu_ptr, l_ptr, sums_ptr,
                          N_EXTRA: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    off = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    acc_l = tl.zeros([BLOCK], dtype=tl.float64)
    acc_lr = tl.zeros([BLOCK], dtype=tl.float64)
    acc_n = tl.zeros([BLOCK], dtype=tl.float64)
    while off < end:  # a while loop: bounds read on the device (also runs under the interpreter)
        idx = off + tl.arange(0, BLOCK)
        inside = idx < end
        v = (tl.load(valid_ptr + idx, mask=inside, other=0) != 0) & inside
        lt = tl.load(lt_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        lr = tl.load(lr_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        raw = lt - lr
        if N_EXTRA >= 1:
            raw = _nan_unless_finite(raw, tl.load(e0_ptr + idx, mask=inside, other=0.0).to(tl.float32))
        if N_EXTRA >= 2:
            raw = _nan_unless_finite(raw, tl.load(e1_ptr + idx, mask=inside, other=0.0).to(tl.float32))
        l = tl.where(v, raw, 0.0)  # noqa: E741
        tl.store(l_ptr + idx, l, mask=inside)
        acc_l += l.to(tl.float64)
        acc_lr += tl.where(v, lr, 0.0).to(tl.float64)
        acc_n += v.to(tl.float64)
        off += BLOCK
    tl.store(sums_ptr + 3 * i, tl.sum(acc_l, axis=0))
    tl.store(sums_ptr + 3 * i + 1, tl.sum(acc_lr, axis=0))
    tl.store(sums_ptr + 3 * i + 2, tl.sum(acc_n, axis=0))


def sequence_sums(lp_train: Tensor, lp_rollout: Tensor, valid: Tensor, offsets: Tensor,
                  extra_finite: tuple[Tensor, ...] = (), block: int = 256) -> tuple[Tensor, Tensor]:
    """``(l [T] float32, sums [n_seq, 3] float64)`` (module docstring); ``offsets``: int64 ``cu_seqlens``."""
    if len(extra_finite) > MAX_EXTRA:
        raise ValueError(f"sequence_sums: at most {MAX_EXTRA} extra_finite tensors, got {len(extra_finite)}")
    n_seq = offsets.numel() - 1
    lt, lr = lp_train.contiguous(), lp_rollout.contiguous()
    extras = [t.contiguous() for t in extra_finite] + [lt] * (MAX_EXTRA - len(extra_finite))
    l_out = torch.empty(lt.shape, dtype=torch.float32, device=lt.device)
    sums = torch.empty((n_seq, 3), dtype=torch.float64, device=lt.device)
    if n_seq > 0:
        with launching("correction"):  # a failure: KernelLaunchError, the caller runs the torch code
            _sequence_sums_kernel[(n_seq,)](lt, lr, valid.contiguous().view(torch.uint8), extras[0], extras[1],
                                            offsets.contiguous(), l_out, sums,
                                            N_EXTRA=len(extra_finite), BLOCK=block)
    return l_out, sums
