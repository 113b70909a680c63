"""Fused Triton kernels: token log-probs and entropies from vocab-parallel logits, one pass each way.

Same formulas as the torch reference :mod:`slime_tis.engine.logprobs` (the semantics and the CPU path).
Tensor-parallel rank ``r`` holds the logit columns ``[vocab_start, vocab_start + Vp)``. Per row with logits
``z [Vp]``, temperature ``tau`` and global target id ``y``, all math in float32:

    x = z / tau
    forward, one read of the row (online over column blocks):
        m_r = max_v x_v                      local max (float32 min when the whole shard is -inf)
        s_r = sum_v exp(x_v - m_r)
        e_r = sum_v exp(x_v - m_r) (x_v - m_r)          (only with entropy)
        t_r = max(x_y, float32 min) on the rank owning y, else 0
    combination over the TP group (none at TP = 1, where the kernel finishes the row itself):
        M = all-reduce MAX of m_r                         [T]
        a_r = exp(m_r - M)
        (S, E, X_y) = all-reduce SUM of (a_r s_r, a_r (e_r + (m_r - M) s_r), t_r)     [T, 3]
        logZ = M + log S,  lp = X_y - logZ,  H = log S - E / S
    backward, one read and one write of the row (no communication):
        lq_v = max(x_v - logZ, -200)          log p_v (p_v is exactly 0 in float32 below -104)
        dL/dz_v = (p_v (-g_lp - g_H (lq_v + H)) + g_lp [v = y]) / tau

Every ``max(a, c)`` clamp above is computed as the selection ``where(a < c, c, a)`` (``_floor``): PTX
``max.f32`` returns the non-NaN operand, so a ``tl.maximum`` clamp would turn a NaN logit into a finite
log-prob on a GPU. ``m_r`` itself may skip a NaN, but ``exp(x_v - m_r)`` carries it into ``s_r``: a row with a
NaN logit has NaN ``logZ``, log-prob and entropy on every backend, as on the torch path.

Rows with ``row_mask == 0`` are neither read nor computed: their log-prob and entropy are 0 and their
gradient row is written as zeros; so is the gradient row of a row whose upstream gradients are both 0 (a
token the loss rejected), without reading it (no ``0 * NaN``). The only ``[T, V/TP]`` tensor is the
gradient itself; everything else is ``O(T)`` (float32 ``[T]`` vectors: outputs, the saved ``logZ``, four
partials at TP > 1). No host synchronisation.

A kernel that fails to compile or launch raises :class:`~slime_tis.kernels.dispatch.KernelLaunchError`
from the forward (the caller, ``slime_tis.engine.logprobs``, then runs the torch code: same collectives);
in the backward the torch code's gradient is computed here instead (``slime_tis.kernels.dispatch``).

This module imports triton at its top; import it lazily (``slime_tis.engine.logprobs`` does).
Run on CPU tensors with ``TRITON_INTERPRET=1`` set before this module is first imported.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from slime_tis.kernels.dispatch import KernelLaunchError, fall_back, launching
from slime_tis.kernels.logprobs_torch import grad_logits

__all__ = ["fused_log_probs_and_entropy", "default_block_v"]

_FMIN = tl.constexpr(-3.4028234663852886e38)  # float32 min: -inf logits become a finite shift (exp -> 0)
_LOGP_MIN = tl.constexpr(-200.0)  # below log(smallest float32 denormal) = -103.3: p is exactly 0


@triton.jit
def _floor(x, lo):
    """``max(x, lo)`` that keeps NaN on every backend (a selection, not PTX ``max.f32``, which drops NaN)."""
    return tl.where(x < lo, lo, x)


@triton.jit
def _lp_fwd_kernel(z_ptr, z_stride, tgt_ptr, mask_ptr, o0_ptr, o1_ptr, o2_ptr, o3_ptr, vocab_start, inv_tau,
                   n_cols: tl.constexpr, HAS_MASK: tl.constexpr, WITH_ENTROPY: tl.constexpr, FINAL: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """One program per row. Outputs ``o0..o3 [T]``: FINAL -> (lp, H, logZ, -); else (m_r, s_r, t_r, e_r)."""
    row = tl.program_id(0).to(tl.int64)
    active = True
    if HAS_MASK:
        active = tl.load(mask_ptr + row) != 0
    if active:
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
        s = tl.sum(s_vec, 0)
        e = tl.sum(e_vec, 0)
        local = tl.load(tgt_ptr + row) - vocab_start
        owns = (local >= 0) & (local < n_cols)
        x_t = tl.load(z_row + tl.where(owns, local, 0)).to(tl.float32) * inv_tau
        t = tl.where(owns, _floor(x_t, _FMIN), 0.0)
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
    else:
        # lp = H = 0 at TP = 1; partials of a neutral row (M = 0, S = P, E = X_y = 0) at TP > 1, zeroed later
        tl.store(o0_ptr + row, 0.0)
        if FINAL:
            tl.store(o1_ptr + row, 0.0)
        else:
            tl.store(o1_ptr + row, 1.0)
        tl.store(o2_ptr + row, 0.0)
        if not FINAL:
            tl.store(o3_ptr + row, 0.0)


@triton.jit
def _lp_bwd_kernel(z_ptr, z_stride, g_ptr, g_stride, tgt_ptr, mask_ptr, logz_ptr, h_ptr, glp_ptr, gh_ptr,
                   vocab_start, inv_tau, n_cols: tl.constexpr,
                   HAS_MASK: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row: ``g[row] = dL/dz`` from the forward's ``logZ [T]`` and ``H [T]``."""
    row = tl.program_id(0).to(tl.int64)
    g_row = g_ptr + row * g_stride
    active = True
    if HAS_MASK:
        active = tl.load(mask_ptr + row) != 0
    g_lp = 0.0
    if HAS_GLP:
        g_lp = tl.load(glp_ptr + row).to(tl.float32)
    g_h = 0.0
    if HAS_GH:
        g_h = tl.load(gh_ptr + row).to(tl.float32)
    # a row without upstream gradient (masked, or a rejected token) is written as zeros without reading its
    # logits: no 0 * NaN from a non-finite row
    if active & ((g_lp != 0.0) | (g_h != 0.0)):
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
            lq = _floor(x - log_z, _LOGP_MIN)
            p = tl.exp(lq)
            coef = -g_lp - g_h * (lq + h)
            g = p * coef + tl.where(cols == local, g_lp, 0.0)
            tl.store(g_row + cols, (g * inv_tau).to(g_ptr.dtype.element_ty), mask=inside)
    else:
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(g_row + cols, tl.zeros([BLOCK_V], dtype=g_ptr.dtype.element_ty), mask=cols < n_cols)


def default_block_v(n_cols: int) -> int:
    """Columns per loop step: the next power of two of ``V/TP``, capped at 4096 (and >= 16)."""
    return max(16, min(4096, triton.next_power_of_2(max(n_cols, 1))))


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def _mask_u8(row_mask: Tensor | None, n_rows: int) -> Tensor | None:
    if row_mask is None:
        return None
    m = row_mask.reshape(-1)
    if m.dtype == torch.bool:
        return m.contiguous().view(torch.uint8)
    return (m != 0).view(torch.uint8)


def _check_device(t: Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton log-prob kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), "
                         f"got logits on {t.device}")


def _combine_partials(m_r: Tensor, s_r: Tensor, t_r: Tensor, e_r: Tensor, group: dist.ProcessGroup,
                      with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's ``(m_r, s_r, t_r, e_r) [T]`` -> global ``(lp, H, logZ)``: one MAX of [T], one SUM of [T, 3]."""
    big_m = m_r.clone()
    dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
    d = m_r - big_m
    alpha = torch.exp(d)
    sums = torch.stack([alpha * s_r, t_r, alpha * (e_r + d * s_r)], dim=1)
    dist.all_reduce(sums, group=group)
    s, x_t, e = sums.unbind(1)
    log_s = torch.log(s)
    log_z = big_m + log_s
    entropy = log_s - e / s if with_entropy else torch.zeros_like(log_s)
    return x_t - log_z, entropy, log_z


class _FusedLogProbEntropy(torch.autograd.Function):
    """``(logits [T, Vp], targets [T]) -> (log_probs [T], entropy [T])`` float32, by the Triton kernels."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, row_mask: Tensor | None, temperature: float,
                group: dist.ProcessGroup | None, tp_size: int, vocab_start: int, with_entropy: bool,
                block_v: int, num_warps: int):
        n_tok, vp = logits.shape
        out = [torch.empty(n_tok, dtype=torch.float32, device=logits.device) for _ in range(3 if tp_size == 1 else 4)]
        if n_tok:
            with launching("logprobs"):  # a failure here leaves the caller to run the torch code instead
                _lp_fwd_kernel[(n_tok,)](
                    logits, logits.stride(0), targets, row_mask if row_mask is not None else targets, *out[:3],
                    out[-1], vocab_start, 1.0 / temperature, n_cols=vp,
                    HAS_MASK=row_mask is not None, WITH_ENTROPY=with_entropy, FINAL=tp_size == 1,
                    BLOCK_V=block_v, num_warps=num_warps)
        if tp_size == 1:
            log_probs, entropy, log_z = out
        else:
            log_probs, entropy, log_z = _combine_partials(*out, group, with_entropy)
            if row_mask is not None:
                keep = row_mask.view(torch.bool)
                log_probs = torch.where(keep, log_probs, 0.0)
                entropy = torch.where(keep, entropy, 0.0)
        ctx.save_for_backward(logits, targets, row_mask, log_z, entropy)  # [T] vectors besides the logits
        ctx.set_materialize_grads(False)  # an unused output costs no backward work
        ctx.temperature, ctx.vocab_start, ctx.with_entropy = temperature, vocab_start, with_entropy
        ctx.block_v, ctx.num_warps = block_v, num_warps
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_h: Tensor | None):
        logits, targets, row_mask, log_z, entropy = ctx.saved_tensors
        n_tok, vp = logits.shape
        grad = torch.empty((n_tok, vp), dtype=logits.dtype, device=logits.device)
        use_h = ctx.with_entropy and grad_h is not None
        if n_tok:
            g_lp = grad_lp.contiguous() if grad_lp is not None else log_z  # placeholders are never read
            g_h = grad_h.contiguous() if use_h else log_z
            try:
                with launching("logprobs"):
                    _lp_bwd_kernel[(n_tok,)](
                        logits, logits.stride(0), grad, grad.stride(0), targets,
                        row_mask if row_mask is not None else targets, log_z, entropy, g_lp, g_h,
                        ctx.vocab_start, 1.0 / ctx.temperature, n_cols=vp,
                        HAS_MASK=row_mask is not None, HAS_GLP=grad_lp is not None, HAS_GH=use_h,
                        BLOCK_V=ctx.block_v, num_warps=ctx.num_warps)
            except KernelLaunchError as err:  # the torch backward of the same forward (no communication)
                fall_back(err)
                grad = _torch_grad(ctx, logits, targets, row_mask, log_z, entropy, grad_lp, grad_h)
        return grad, None, None, None, None, None, None, None, None, None


def _torch_grad(ctx, logits, targets, row_mask, log_z, entropy, grad_lp, grad_h) -> Tensor:
    """The torch code's ``dL/dz`` (:func:`slime_tis.kernels.logprobs_torch.grad_logits`) from this forward's state."""
    local = targets - ctx.vocab_start
    in_shard = (local >= 0) & (local < logits.shape[1])
    safe_idx = torch.where(in_shard, local, torch.zeros_like(local))
    keep = None if row_mask is None else row_mask.view(torch.bool)
    return grad_logits(logits, safe_idx, in_shard, log_z, entropy, keep, grad_lp, grad_h,
                       temperature=ctx.temperature, chunk_size=1024, with_entropy=ctx.with_entropy)


def fused_log_probs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    with_entropy: bool = True,
    row_mask: Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of ``targets`` and entropy of ``softmax(logits / temperature)`` (Triton, see module doc).

    Args:
        logits: ``[T, Vp]`` this rank's vocabulary shard, float32 / bfloat16 / float16, on CUDA (or CPU
            under ``TRITON_INTERPRET=1``).
        targets: ``[T]`` int64 global vocabulary ids.
        temperature: ``tau > 0``.
        group: the TP process group (``None`` or one rank: no communication).
        vocab_start: first global vocabulary id of this shard (``tp_rank * Vp``).
        with_entropy: compute the entropy (else it is returned as zeros and costs nothing).
        row_mask: ``[T]`` optional; rows where it is 0/False cost no work and get ``lp = H = 0`` and a zero
            gradient row.
        block_v: columns per loop step (a power of two; default :func:`default_block_v`).
        num_warps: warps per row program (default 8 for blocks of >= 2048 columns, else 4).

    Returns:
        ``(log_probs [T], entropy [T])`` float32, differentiable with respect to ``logits``.
    """
    _check_device(logits)
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [T, V/TP] and targets [T], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if block_v is None:
        block_v = default_block_v(logits.shape[1])
    elif block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v!r}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tp_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    mask = _mask_u8(row_mask, logits.shape[0])
    if mask is not None and mask.shape[0] != logits.shape[0]:
        raise ValueError(f"row_mask must have {logits.shape[0]} entries, got {tuple(row_mask.shape)}")
    return _FusedLogProbEntropy.apply(logits, targets.to(torch.int64).contiguous(), mask, float(temperature),
                                      group, tp_size, int(vocab_start), bool(with_entropy), int(block_v),
                                      int(num_warps or _num_warps(block_v)))
