"""Triton kernels of token log-probs and entropies from vocab-parallel logits: over the full vocabulary
(:func:`fused_log_probs_and_entropy`) or over each row's sampled support (:func:`support_log_probs_and_entropy`).

One program per row, one read of the row forward, one read and one write backward; the torch code
(:mod:`slime_tis.engine.logprobs`) is the reference. Formulas, collectives and the NaN rules: docs/kernels.md,
"What the kernels compute" and "Non-finite values"; the replay: docs/sampling_support.md. A compile or launch
failure raises ``KernelLaunchError`` before any collective (forward) or falls back to the torch gradient
(backward). Imports triton: import lazily, with ``TRITON_INTERPRET=1`` set first on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from slime_tis.kernels import logprobs_torch as ref
from slime_tis.kernels.dispatch import KernelLaunchError, fall_back, group_size, launching

__all__ = ["fused_log_probs_and_entropy", "support_log_probs_and_entropy", "default_block_v"]

_FMIN = tl.constexpr(-3.4028234663852886e38)  # float32 min: -inf logits become a finite shift (exp -> 0)
_LOGP_MIN = tl.constexpr(-200.0)  # below log(smallest float32 denormal) = -103.3: p is exactly 0
_BLOCK_S = 64  # kept ids per loop step of the replay kernels


@triton.jit
def _floor(x, lo):
    """``max(x, lo)`` that keeps NaN on every backend (a selection, not PTX ``max.f32``, which drops NaN)."""
    return tl.where(x < lo, lo, x)


@triton.jit
def _finish_row(o0_ptr, o1_ptr, o2_ptr, o3_ptr, row, m, s, e, t, WITH_ENTROPY: tl.constexpr, FINAL: tl.constexpr):
    """FINAL (TP = 1): ``o0..o2 = (lp, H, logZ)``; else this rank's partials ``o0..o3 = (m, s, t, e)``."""
    if FINAL:
        log_s = tl.log(s)
        log_z = m + log_s
        tl.store(o0_ptr + row, t - log_z)
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


@triton.jit
def _store_masked_row(o0_ptr, o1_ptr, o2_ptr, o3_ptr, row, FINAL: tl.constexpr):
    """A row outside ``row_mask``: ``lp = H = logZ = 0`` (FINAL), else a neutral row's partials (zeroed later)."""
    tl.store(o0_ptr + row, 0.0)
    if FINAL:
        tl.store(o1_ptr + row, 0.0)
    else:
        tl.store(o1_ptr + row, 1.0)
        tl.store(o3_ptr + row, 0.0)
    tl.store(o2_ptr + row, 0.0)


@triton.jit
def _kept(row, mask_ptr, HAS_MASK: tl.constexpr):
    """Whether ``row_mask`` keeps ``row`` (every row without a mask)."""
    active = True
    if HAS_MASK:
        active = tl.load(mask_ptr + row) != 0
    return active


@triton.jit
def _upstream(row, mask_ptr, glp_ptr, gh_ptr, HAS_MASK: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr):
    """``(live, g_lp, g_H)``: a row is live when kept with a nonzero upstream gradient (else zeros, never read)."""
    active = _kept(row, mask_ptr, HAS_MASK)
    g_lp = 0.0
    if HAS_GLP:
        g_lp = tl.load(glp_ptr + row).to(tl.float32)
    g_h = 0.0
    if HAS_GH:
        g_h = tl.load(gh_ptr + row).to(tl.float32)
    return active & ((g_lp != 0.0) | (g_h != 0.0)), g_lp, g_h


@triton.jit
def _dlogit(x, log_z, h, g_lp, g_h, is_target):
    """``dL/dx = p (-g_lp - g_H (log p + H)) + g_lp [v = y]`` (``log p`` floored; ``dL/dz = dL/dx / tau``)."""
    lq = _floor(x - log_z, _LOGP_MIN)
    return tl.exp(lq) * (-g_lp - g_h * (lq + h)) + tl.where(is_target, g_lp, 0.0)


@triton.jit
def _lp_fwd_kernel(z_ptr, z_stride, tgt_ptr, mask_ptr, o0_ptr, o1_ptr, o2_ptr, o3_ptr, vocab_start, inv_tau,
                   n_cols: tl.constexpr, HAS_MASK: tl.constexpr, WITH_ENTROPY: tl.constexpr, FINAL: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if _kept(row, mask_ptr, HAS_MASK):
        z_row = z_ptr + row * z_stride
        # one shared running max m; per-lane partial sums (one cross-lane reduction per step, for the max)
        m = _FMIN
        s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        e_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(z_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * inv_tau
            m_new = tl.maximum(m, tl.max(x, 0))  # may skip a NaN (PTX max.f32): y below still carries it
            y = _floor(x - m_new, _FMIN)         # -inf (and padding) -> finite, exp -> 0; NaN stays NaN
            p = tl.exp(y)
            alpha = tl.exp(m - m_new)
            if WITH_ENTROPY:
                e_vec = alpha * (e_vec + (m - m_new) * s_vec) + p * y
            s_vec = s_vec * alpha + p
            m = m_new
        local = tl.load(tgt_ptr + row) - vocab_start
        owns = (local >= 0) & (local < n_cols)
        x_t = tl.load(z_row + tl.where(owns, local, 0)).to(tl.float32) * inv_tau
        t = tl.where(owns, _floor(x_t, _FMIN), 0.0)
        _finish_row(o0_ptr, o1_ptr, o2_ptr, o3_ptr, row, m, tl.sum(s_vec, 0), tl.sum(e_vec, 0), t, WITH_ENTROPY,
                    FINAL)
    else:
        _store_masked_row(o0_ptr, o1_ptr, o2_ptr, o3_ptr, row, FINAL)


@triton.jit
def _lp_bwd_kernel(z_ptr, z_stride, g_ptr, g_stride, tgt_ptr, mask_ptr, logz_ptr, h_ptr, glp_ptr, gh_ptr,
                   vocab_start, inv_tau, n_cols: tl.constexpr,
                   HAS_MASK: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g_row = g_ptr + row * g_stride
    live, g_lp, g_h = _upstream(row, mask_ptr, glp_ptr, gh_ptr, HAS_MASK, HAS_GLP, HAS_GH)
    if live:
        z_row = z_ptr + row * z_stride
        log_z = tl.load(logz_ptr + row)
        h = 0.0
        if HAS_GH:
            h = tl.load(h_ptr + row)
        local = tl.load(tgt_ptr + row) - vocab_start
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            inside = cols < n_cols
            x = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32) * inv_tau
            g = _dlogit(x, log_z, h, g_lp, g_h, cols == local)
            tl.store(g_row + cols, (g * inv_tau).to(g_ptr.dtype.element_ty), mask=inside)
    else:
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(g_row + cols, tl.zeros([BLOCK_V], dtype=g_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _support_block(ids_ptr, start, s1, vocab_start, n_cols, BLOCK_S: tl.constexpr):
    """A block of the row's kept ids from ``start``: ``(ids, col, own)``, ``own``: in the row and in this shard."""
    k = start + tl.arange(0, BLOCK_S)
    inside = k < s1
    ids = tl.load(ids_ptr + k, mask=inside, other=-1).to(tl.int64)
    col = ids - vocab_start
    return ids, col, inside & (col >= 0) & (col < n_cols)


@triton.jit
def _support_fwd_kernel(z_ptr, z_stride, tgt_ptr, ids_ptr, off_ptr, mask_ptr, o0_ptr, o1_ptr, o2_ptr, o3_ptr,
                        o4_ptr, vocab_start, inv_tau, n_cols, HAS_MASK: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                        FINAL: tl.constexpr, BLOCK_S: tl.constexpr):
    """As ``_lp_fwd_kernel`` over the row's kept ids; ``o4`` (TP > 1): how many kept owned ids equal the target."""
    row = tl.program_id(0).to(tl.int64)
    if _kept(row, mask_ptr, HAS_MASK):
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
            ids, col, own = _support_block(ids_ptr, start, s1, vocab_start, n_cols, BLOCK_S)
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
        t = tl.sum(t_vec, 0)
        c = tl.sum(c_vec, 0)
        if FINAL:
            t = tl.where(c > 0, t, float("nan"))  # the target outside its support: lp NaN
        else:
            tl.store(o4_ptr + row, c)
        _finish_row(o0_ptr, o1_ptr, o2_ptr, o3_ptr, row, m, tl.sum(s_vec, 0), tl.sum(e_vec, 0), t, WITH_ENTROPY,
                    FINAL)
    else:
        _store_masked_row(o0_ptr, o1_ptr, o2_ptr, o3_ptr, row, FINAL)
        if not FINAL:
            tl.store(o4_ptr + row, 1.0)


@triton.jit
def _support_bwd_kernel(z_ptr, z_stride, g_ptr, g_stride, tgt_ptr, ids_ptr, off_ptr, mask_ptr, logz_ptr, h_ptr,
                        glp_ptr, gh_ptr, vocab_start, inv_tau, n_cols, HAS_MASK: tl.constexpr,
                        HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, BLOCK_S: tl.constexpr):
    """``dL/dz`` at the row's kept owned columns (the gradient row starts as zeros)."""
    row = tl.program_id(0).to(tl.int64)
    live, g_lp, g_h = _upstream(row, mask_ptr, glp_ptr, gh_ptr, HAS_MASK, HAS_GLP, HAS_GH)
    if live:
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
            ids, col, own = _support_block(ids_ptr, start, s1, vocab_start, n_cols, BLOCK_S)
            safe = tl.where(own, col, 0)
            x = tl.load(z_row + safe, mask=own, other=0.0).to(tl.float32) * inv_tau
            g = _dlogit(x, log_z, h, g_lp, g_h, ids == y)
            tl.store(g_row + safe, (g * inv_tau).to(g_ptr.dtype.element_ty), mask=own)


def default_block_v(n_cols: int) -> int:
    """Columns per loop step: the next power of two of ``V/TP``, capped at 4096 (and >= 16)."""
    return max(16, min(4096, triton.next_power_of_2(max(n_cols, 1))))


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


class _LogProbEntropy(torch.autograd.Function):
    """``(logits [T, Vp], targets [T][, ids [S], offsets [T + 1]]) -> (log_probs [T], entropy [T])`` float32."""

    @staticmethod
    def forward(ctx, logits, targets, ids, offsets, row_mask, temperature, group, tp_size, vocab_start, with_entropy,
                block, num_warps):
        n_tok, vp = logits.shape
        support = ids is not None
        out = [torch.empty(n_tok, dtype=torch.float32, device=logits.device)
               for _ in range(3 if tp_size == 1 else 5 if support else 4)]
        mask = row_mask if row_mask is not None else targets  # a placeholder, never read without HAS_MASK
        slots = out + [out[-1]] * (5 - len(out))  # the kernels' output slots, unused ones aliasing (never written)
        flags = dict(HAS_MASK=row_mask is not None, WITH_ENTROPY=with_entropy, FINAL=tp_size == 1)
        if n_tok:
            with launching("logprobs"):  # a failure here leaves the caller to run the torch code instead
                if support:
                    _support_fwd_kernel[(n_tok,)](logits, logits.stride(0), targets, ids, offsets, mask, *slots,
                                                  vocab_start, 1.0 / temperature, vp, BLOCK_S=block, **flags)
                else:
                    _lp_fwd_kernel[(n_tok,)](logits, logits.stride(0), targets, mask, *slots[:4], vocab_start,
                                             1.0 / temperature, n_cols=vp, BLOCK_V=block, num_warps=num_warps,
                                             **flags)
        lp, ent, log_z = out if tp_size == 1 else ref.combine_partials(
            *out[:4], group, with_entropy, *out[4:], keep=None if row_mask is None else row_mask.view(torch.bool))
        ctx.save_for_backward(logits, targets, ids, offsets, row_mask, log_z, ent)  # [T] vectors besides logits
        ctx.set_materialize_grads(False)  # an unused output costs no backward work
        ctx.args = temperature, vocab_start, with_entropy, block, num_warps
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_h):
        logits, targets, ids, offsets, row_mask, log_z, entropy = ctx.saved_tensors
        temperature, vocab_start, with_entropy, block, num_warps = ctx.args
        n_tok, vp = logits.shape
        support = ids is not None
        # the replay writes its kept columns only; the full kernel writes every row
        grad = (torch.zeros if support else torch.empty)((n_tok, vp), dtype=logits.dtype, device=logits.device)
        use_h = with_entropy and grad_h is not None
        if not n_tok:
            return grad, *[None] * 11
        g_lp = grad_lp.contiguous() if grad_lp is not None else log_z  # placeholders are never read
        g_h = grad_h.contiguous() if use_h else log_z
        mask = row_mask if row_mask is not None else targets
        flags = dict(HAS_MASK=row_mask is not None, HAS_GLP=grad_lp is not None, HAS_GH=use_h)
        keep = None if row_mask is None else row_mask.view(torch.bool)
        try:
            with launching("logprobs"):
                if support:
                    _support_bwd_kernel[(n_tok,)](logits, logits.stride(0), grad, grad.stride(0), targets, ids,
                                                  offsets, mask, log_z, entropy, g_lp, g_h, vocab_start,
                                                  1.0 / temperature, vp, BLOCK_S=block, **flags)
                else:
                    _lp_bwd_kernel[(n_tok,)](logits, logits.stride(0), grad, grad.stride(0), targets, mask, log_z,
                                             entropy, g_lp, g_h, vocab_start, 1.0 / temperature, n_cols=vp,
                                             BLOCK_V=block, num_warps=num_warps, **flags)
        except KernelLaunchError as err:  # the torch code's gradient of the same forward (no communication)
            fall_back(err)
            if support:
                rows = ref.support_rows(ids, offsets, targets, vocab_start, vp)
                x = logits[rows.row, rows.col].to(torch.float32) / temperature
                g = ref.support_grad(x, rows, log_z, entropy, keep, grad_lp, grad_h, temperature, with_entropy)
                grad.zero_().index_put_((rows.row, rows.col), g.to(grad.dtype), accumulate=True)
            else:
                grad = ref.grad_logits(logits, *ref.target_column(targets, vocab_start, vp), log_z, entropy, keep,
                                       grad_lp, grad_h, temperature=temperature, chunk_size=ref.CHUNK_SIZE,
                                       with_entropy=with_entropy)
        return grad, *[None] * 11


def _apply(logits, targets, ids, offsets, temperature, group, vocab_start, with_entropy, row_mask, block, num_warps):
    if logits.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton log-prob kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU), "
                         f"got logits on {logits.device}")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [T, V/TP] and targets [T], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if row_mask is not None and row_mask.numel() != logits.shape[0]:
        raise ValueError(f"row_mask must have {logits.shape[0]} entries, got {tuple(row_mask.shape)}")
    mask = None if row_mask is None else (row_mask.reshape(-1) != 0).view(torch.uint8)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _LogProbEntropy.apply(logits, targets.to(torch.int64).contiguous(), ids, offsets, mask, float(temperature),
                                 group, group_size(group), int(vocab_start), bool(with_entropy), block, num_warps)


def fused_log_probs_and_entropy(logits: Tensor, targets: Tensor, *, temperature: float = 1.0,
                                group: dist.ProcessGroup | None = None, vocab_start: int = 0, with_entropy: bool = True,
                                row_mask: Tensor | None = None, block_v: int | None = None,
                                num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """``(log_probs [T], entropy [T])`` float32 of ``softmax(logits / temperature)``, differentiable w.r.t. ``logits
    [T, Vp]`` (this shard, from ``vocab_start``), as the torch path computes them (``group``: TP; ``row_mask [T]``:
    rows where it is 0 cost nothing; ``with_entropy=False``: ``H`` zeros); ``block_v`` (a power of two) and
    ``num_warps``: the launch (default :func:`default_block_v`, 8 warps for blocks of >= 2048 columns, else 4)."""
    if block_v is None:
        block_v = default_block_v(logits.shape[-1])
    elif block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v!r}")
    return _apply(logits, targets, None, None, temperature, group, vocab_start, with_entropy, row_mask, int(block_v),
                  int(num_warps or _num_warps(block_v)))


def support_log_probs_and_entropy(logits: Tensor, targets: Tensor, ids: Tensor, offsets: Tensor, *,
                                  temperature: float = 1.0, group: dist.ProcessGroup | None = None,
                                  vocab_start: int = 0, with_entropy: bool = True,
                                  row_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`fused_log_probs_and_entropy` restricted to each row's support and renormalised there: row ``t`` keeps
    the global ids ``ids[offsets[t]:offsets[t + 1]]`` (distinct); ``lp`` NaN where the target is not kept."""
    return _apply(logits, targets, ids.to(torch.int32).contiguous(), offsets.to(torch.int64).contiguous(), temperature,
                  group, vocab_start, with_entropy, row_mask, _BLOCK_S, 4)
