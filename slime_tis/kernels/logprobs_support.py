"""Triton kernels of the sampling-support replay from vocab-parallel logits: each row reads its kept logits only.

Same function as the torch code (:mod:`slime_tis.engine.support_logprobs`, formulas in
:mod:`slime_tis.kernels.support_torch`). Row ``t`` keeps the global ids ``ids[offsets[t]:offsets[t + 1]]``;
this shard owns the columns ``[vocab_start, vocab_start + Vp)``. One program per row, in float32:

    forward, one read of the row's kept logits (online over blocks of kept ids):
        m_r = max x_v, s_r = sum exp(x_v - m_r), e_r = sum exp(x_v - m_r)(x_v - m_r)   (v kept and owned)
        t_r = x_y where the target is kept and owned (else 0), c_r = how many kept owned ids equal y
    TP = 1: the program finishes the row (lp = t - logZ, NaN when c = 0; H = log s - e / s);
    TP > 1: the torch combination, the same collectives as the torch replay: MAX of ``m [T]``, SUM of
        ``[T, 4]`` = (a s_r, t_r, a (e_r + (m_r - M) s_r), c_r), ``a = exp(m_r - M)``
    backward, one read of the kept logits and one write of their gradient (the rest of the gradient row is the
    zeros it was allocated with):
        lq_v = max(x_v - logZ, -200),  dL/dz_v = (exp(lq_v) (-g_lp - g_H (lq_v + H)) + g_lp [v = y]) / tau

Rows with ``row_mask == 0``, and in the backward rows without an upstream gradient, are not read. A row's ids
must be distinct (the rollout side validates it: a repeated id would be stored, not summed, in the backward).

Kernel failures: the forward raises :class:`~slime_tis.kernels.dispatch.KernelLaunchError` before any
collective (the caller runs the torch replay), the backward computes the torch replay's gradient instead.
This module imports triton at its top (import it lazily); on CPU set ``TRITON_INTERPRET=1`` before that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from slime_tis.kernels.dispatch import KernelLaunchError, fall_back, launching
from slime_tis.kernels.support_torch import support_grad, support_rows

__all__ = ["support_log_probs_and_entropy"]

_FMIN = tl.constexpr(-3.4028234663852886e38)
_LOGP_MIN = tl.constexpr(-200.0)


@triton.jit
def _floor(x, lo):
    """``max(x, lo)`` that keeps NaN (a selection, not PTX ``max.f32``)."""
    return tl.where(x < lo, lo, x)


@triton.jit
def _support_fwd_kernel(z_ptr, z_stride, tgt_ptr, ids_ptr, off_ptr, mask_ptr, o0_ptr, o1_ptr, o2_ptr, o3_ptr,
                        o4_ptr, vocab_start, inv_tau, n_cols, HAS_MASK: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                        FINAL: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per row. FINAL: ``o0..o2 = (lp, H, logZ)``; else ``o0..o4 = (m_r, s_r, t_r, e_r, c_r)``."""
    row = tl.program_id(0).to(tl.int64)
    active = True
    if HAS_MASK:
        active = tl.load(mask_ptr + row) != 0
    if active:
        z_row = z_ptr + row * z_stride
        y = tl.load(tgt_ptr + row)
        s0 = tl.load(off_ptr + row)
        s1 = tl.load(off_ptr + row + 1)
        m = _FMIN
        s_vec = tl.zeros([BLOCK_S], dtype=tl.float32)
        e_vec = tl.zeros([BLOCK_S], dtype=tl.float32)
        t_vec = tl.zeros([BLOCK_S], dtype=tl.float32)
        c_vec = tl.zeros([BLOCK_S], dtype=tl.float32)
        for start in range(s0, s1, BLOCK_S):
            k = start + tl.arange(0, BLOCK_S)
            inside = k < s1
            ids = tl.load(ids_ptr + k, mask=inside, other=-1).to(tl.int64)
            col = ids - vocab_start
            own = inside & (col >= 0) & (col < n_cols)
            x = tl.load(z_row + tl.where(own, col, 0), mask=own, other=float("-inf")).to(tl.float32) * inv_tau
            x = tl.where(own, x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            d = _floor(x - m_new, _FMIN)
            p = tl.where(own, tl.exp(d), 0.0)
            alpha = tl.exp(m - m_new)
            if WITH_ENTROPY:
                e_vec = alpha * (e_vec + (m - m_new) * s_vec) + p * d
            s_vec = s_vec * alpha + p
            m = m_new
            hit = own & (ids == y)
            t_vec = t_vec + tl.where(hit, _floor(x, _FMIN), 0.0)
            c_vec = c_vec + tl.where(hit, 1.0, 0.0)
        s = tl.sum(s_vec, 0)
        e = tl.sum(e_vec, 0)
        t = tl.sum(t_vec, 0)
        c = tl.sum(c_vec, 0)
        if FINAL:
            log_s = tl.log(s)
            log_z = m + log_s
            tl.store(o0_ptr + row, tl.where(c > 0, t - log_z, float("nan")))
            if WITH_ENTROPY:
                tl.store(o1_ptr + row, log_s - e / s)
            else:
                tl.store(o1_ptr + row, 0.0)
            tl.store(o2_ptr + row, log_z)
        else:
            tl.store(o0_ptr + row, m)
            tl.store(o1_ptr + row, s)
            tl.store(o2_ptr + row, t)
            tl.store(o3_ptr + row, e)
            tl.store(o4_ptr + row, c)
    else:
        # lp = H = 0 at TP = 1; a neutral row's partials at TP > 1 (its outputs are zeroed after the combination)
        tl.store(o0_ptr + row, 0.0)
        if FINAL:
            tl.store(o1_ptr + row, 0.0)
        else:
            tl.store(o1_ptr + row, 1.0)
            tl.store(o3_ptr + row, 0.0)
            tl.store(o4_ptr + row, 1.0)
        tl.store(o2_ptr + row, 0.0)


@triton.jit
def _support_bwd_kernel(z_ptr, z_stride, g_ptr, g_stride, tgt_ptr, ids_ptr, off_ptr, mask_ptr, logz_ptr, h_ptr,
                        glp_ptr, gh_ptr, vocab_start, inv_tau, n_cols, HAS_MASK: tl.constexpr,
                        HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per row: ``dL/dz`` at the row's kept owned columns (the gradient row starts as zeros)."""
    row = tl.program_id(0).to(tl.int64)
    active = True
    if HAS_MASK:
        active = tl.load(mask_ptr + row) != 0
    g_lp = 0.0
    if HAS_GLP:
        g_lp = tl.load(glp_ptr + row).to(tl.float32)
    g_h = 0.0
    if HAS_GH:
        g_h = tl.load(gh_ptr + row).to(tl.float32)
    if active & ((g_lp != 0.0) | (g_h != 0.0)):
        z_row = z_ptr + row * z_stride
        g_row = g_ptr + row * g_stride
        y = tl.load(tgt_ptr + row)
        log_z = tl.load(logz_ptr + row)
        h = 0.0
        if HAS_GH:
            h = tl.load(h_ptr + row)
        s0 = tl.load(off_ptr + row)
        s1 = tl.load(off_ptr + row + 1)
        for start in range(s0, s1, BLOCK_S):
            k = start + tl.arange(0, BLOCK_S)
            inside = k < s1
            ids = tl.load(ids_ptr + k, mask=inside, other=-1).to(tl.int64)
            col = ids - vocab_start
            own = inside & (col >= 0) & (col < n_cols)
            safe = tl.where(own, col, 0)
            x = tl.load(z_row + safe, mask=own, other=0.0).to(tl.float32) * inv_tau
            lq = _floor(x - log_z, _LOGP_MIN)
            g = tl.exp(lq) * (-g_lp - g_h * (lq + h)) + tl.where(ids == y, g_lp, 0.0)
            tl.store(g_row + safe, (g * inv_tau).to(g_ptr.dtype.element_ty), mask=own)


def _combine(parts: list[Tensor], group: dist.ProcessGroup, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's ``(m, s, t, e, c) [T]`` -> global ``(lp, H, logZ)``: one MAX of ``[T]``, one SUM of ``[T, 4]``."""
    m_r, s_r, t_r, e_r, c_r = parts
    big_m = m_r.clone()
    dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
    d = m_r - big_m
    a = torch.exp(d)
    sums = torch.stack([a * s_r, t_r, a * (e_r + d * s_r), c_r], dim=1)
    dist.all_reduce(sums, group=group)
    s, x_t, e, c = sums.unbind(1)
    log_s = torch.log(s)
    log_z = big_m + log_s
    lp = torch.where(c > 0, x_t - log_z, torch.full_like(log_z, float("nan")))
    return lp, (log_s - e / s if with_entropy else torch.zeros_like(log_s)), log_z


class _SupportLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ids, offsets, row_mask, temperature, group, tp_size, vocab_start,
                with_entropy, block_s):
        n_tok, vp = logits.shape
        out = [torch.empty(n_tok, dtype=torch.float32, device=logits.device) for _ in range(3 if tp_size == 1 else 5)]
        out5 = out + [out[-1]] * (5 - len(out))  # unused output slots at TP = 1 (never written)
        if n_tok:
            with launching("logprobs"):
                _support_fwd_kernel[(n_tok,)](
                    logits, logits.stride(0), targets, ids, offsets, row_mask if row_mask is not None else targets,
                    *out5, vocab_start, 1.0 / temperature, vp, HAS_MASK=row_mask is not None,
                    WITH_ENTROPY=with_entropy, FINAL=tp_size == 1, BLOCK_S=block_s)
        if tp_size == 1:
            lp, ent, log_z = out
        else:
            lp, ent, log_z = _combine(out, group, with_entropy)
            if row_mask is not None:
                keep = row_mask.view(torch.bool)
                lp, ent = torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)
        ctx.save_for_backward(logits, targets, ids, offsets, row_mask, log_z, ent)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.vocab_start = temperature, vocab_start
        ctx.with_entropy, ctx.block_s = with_entropy, block_s
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_h):
        logits, targets, ids, offsets, row_mask, log_z, entropy = ctx.saved_tensors
        n_tok, vp = logits.shape
        grad = torch.zeros((n_tok, vp), dtype=logits.dtype, device=logits.device)
        use_h = ctx.with_entropy and grad_h is not None
        if n_tok:
            g_lp = grad_lp.contiguous() if grad_lp is not None else log_z  # placeholders are never read
            g_h = grad_h.contiguous() if use_h else log_z
            try:
                with launching("logprobs"):
                    _support_bwd_kernel[(n_tok,)](
                        logits, logits.stride(0), grad, grad.stride(0), targets, ids, offsets,
                        row_mask if row_mask is not None else targets, log_z, entropy, g_lp, g_h, ctx.vocab_start,
                        1.0 / ctx.temperature, vp, HAS_MASK=row_mask is not None, HAS_GLP=grad_lp is not None,
                        HAS_GH=use_h, BLOCK_S=ctx.block_s)
            except KernelLaunchError as err:  # the torch replay's gradient of the same forward
                fall_back(err)
                rows = support_rows(ids, offsets, targets, ctx.vocab_start, vp)
                x = logits[rows.row, rows.col].to(torch.float32) / ctx.temperature
                keep = None if row_mask is None else row_mask.view(torch.bool)
                g = support_grad(x, rows, log_z, entropy, keep, grad_lp, grad_h, ctx.temperature, ctx.with_entropy)
                grad.zero_().index_put_((rows.row, rows.col), g.to(grad.dtype), accumulate=True)
        return grad, None, None, None, None, None, None, None, None, None, None


def support_log_probs_and_entropy(logits: Tensor, targets: Tensor, ids: Tensor, offsets: Tensor, *,
                                  temperature: float = 1.0, group: dist.ProcessGroup | None = None,
                                  vocab_start: int = 0, with_entropy: bool = True, row_mask: Tensor | None = None,
                                  block_s: int = 64) -> tuple[Tensor, Tensor]:
    """The replay's ``(log_probs [T], entropy [T])`` (float32, differentiable w.r.t. ``logits [T, Vp]``) by the
    Triton kernels; ``ids [S]`` / ``offsets [T + 1]`` the CSR of global ids, the rest as
    :func:`slime_tis.kernels.logprobs.fused_log_probs_and_entropy`; ``block_s`` kept ids per loop step."""
    if block_s < 1 or block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of two, got {block_s!r}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tp_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    mask = None
    if row_mask is not None:
        m = row_mask.reshape(-1)
        mask = m.contiguous().view(torch.uint8) if m.dtype == torch.bool else (m != 0).view(torch.uint8)
    return _SupportLogProbEntropy.apply(logits, targets.to(torch.int64).contiguous(), ids.to(torch.int32).contiguous(),
                                        offsets.to(torch.int64).contiguous(), mask, float(temperature), group,
                                        tp_size, int(vocab_start), bool(with_entropy), int(block_s))
