"""Triton kernels of the fused output layer (see :mod:`slime_tis.kernels.output_layer` for the formulas).

Imported lazily (only on the Triton path). Two kernels, both walking logit tiles ``[BT, BV]`` that are
computed from ``hidden [T, H]`` and ``weight [Vp, H]`` with float32 accumulation and never stored:

* ``_stats_kernel``: one program per (block of ``BT`` rows, vocabulary split); online over the split's
  vocabulary tiles it keeps, per row, ``m`` (running max of ``x = z / tau``), ``s = sum exp(x - m)``,
  ``t = sum exp(x - m)(x - m)`` and ``x_y`` (the target's ``x`` when the target is in the split, else 0);
  writes ``[splits, T, 4]`` float32 (merged by the caller). Splits keep the GPU busy when ``T`` is small.
* ``_dlogits_kernel``: one program per ``[BT, BV]`` tile of a vocabulary chunk; recomputes ``x`` and writes
  ``d lp-and-entropy / d z`` for the tile into the chunk buffer. Rows without an upstream gradient (masked, or
  a rejected token: ``g_lp = g_H = 0``) are written as exact zeros by selection (no ``0 * NaN``).
* ``_dhidden_kernel``: one program per ``[BT, BH]`` tile of ``dL/dh``: ``out = acc + d_chunk @ W_chunk`` with
  the float32 accumulator tile loaded once, the chunk's products summed in float32 on the tensor cores and the
  tile stored once (no ``[T, H]`` temporary, no rounding between chunks; the last chunk may store straight in
  the hidden dtype). The weight gradient's GEMM is torch's (``dL/dz^T h``, each chunk's rows written once).

NaN: the online max ``m`` may skip a NaN (PTX ``max.f32`` returns the other operand), but ``exp(x - m)`` of a
NaN ``x`` is NaN, so ``s`` (and with it ``logZ``, the log-prob and the entropy) of a row with a NaN logit is
NaN on every backend; the backward's clamp ``log p <= 0`` is a selection, which keeps NaN too.

Rows are visited in the order ``rows[i]`` (active rows first); blocks whose first index is at or past
``n_active`` (device scalar, read in the kernel: no host sync) skip the matmul: masked rows cost nothing.

Every launch runs inside ``dispatch.launching``: a compile or launch error becomes ``KernelLaunchError``,
on which the caller (:mod:`slime_tis.kernels.output_layer`) continues with the torch code.

Loop bounds (``Vp``, ``H``, the chunk width) are compile-time constants: fixed by the model, so one
compilation per model (two with a ragged last chunk); data-dependent work is skipped with ``if``, never a
runtime loop bound (the Triton 3.6 interpreter cannot take one with numpy >= 2.4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slime_tis.kernels.dispatch import launching

KERNEL = "output_layer"  # the name its fallback goes by (slime_tis.kernels.dispatch)
# CUDA launch: 128 x 128 x 64 tiles, 8 warps, 3 stages (the usual H100 Triton GEMM shape). Not timed (no GPU
# when written); chosen so that the sm_90 build (tests/_output_layer_aot.py) pipelines its loads and spills nothing.
CUDA_BLOCKS = (128, 128, 64)  # (BT, BV, BH)
CUDA_LAUNCH = {"num_warps": 8, "num_stages": 3}
_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": exp(_NEG - m) == 0 and 0 * (_NEG - m) == 0 (no NaN)


@triton.jit
def _logit_tile(h_ptr, w_ptr, rows, active, cols, col_ok, stride_h, stride_w, H: tl.constexpr,
                BT: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr):
    """``z[i, j] = sum_k hidden[rows[i], k] * weight[cols[j], k]`` in float32."""
    acc = tl.zeros((BT, BV), dtype=tl.float32)
    for k0 in range(0, H, BH):
        ks = k0 + tl.arange(0, BH)
        k_ok = ks < H
        a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=active[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :],  # V*H may exceed 2**31
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if PRECISION == "ieee":  # float32 inputs (and the interpreter, whose bf16 tl.dot is wrong): exact fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _stats_kernel(h_ptr, w_ptr, y_ptr, rows_ptr, n_active_ptr, out_ptr,
                  T, vocab_start, temperature, stride_h, stride_w, tiles_per_split,
                  Vp: tl.constexpr, H: tl.constexpr,
                  BT: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * tiles_per_split * BV
    hi = lo + tiles_per_split * BV
    idx = pid * BT + tl.arange(0, BT)
    in_range = idx < T
    n_active = tl.load(n_active_ptr)
    rows = tl.load(rows_ptr + idx, mask=in_range, other=0)
    active = in_range & (idx < n_active)
    target = tl.load(y_ptr + rows, mask=active, other=-1) - vocab_start
    m = tl.full((BT,), _NEG, dtype=tl.float32)
    s = tl.zeros((BT,), dtype=tl.float32)
    t = tl.zeros((BT,), dtype=tl.float32)
    xy = tl.zeros((BT,), dtype=tl.float32)
    if pid * BT < n_active:  # a block of masked rows does no work
        for v0 in range(0, Vp, BV):  # compile-time bound; tiles outside this split are skipped
            if (v0 >= lo) & (v0 < hi):
                cols = v0 + tl.arange(0, BV)
                col_ok = cols < Vp
                z = _logit_tile(h_ptr, w_ptr, rows, active, cols, col_ok, stride_h, stride_w, H, BT, BV, BH,
                                PRECISION)
                x = tl.where(col_ok[None, :], z / temperature, _NEG)
                m_new = tl.maximum(m, tl.max(x, axis=1))
                alpha = tl.exp(m - m_new)
                d = x - m_new[:, None]
                e = tl.exp(d)
                t = alpha * (t + (m - m_new) * s) + tl.sum(e * d, axis=1)
                s = alpha * s + tl.sum(e, axis=1)
                m = m_new
                hit = (cols[None, :] == target[:, None]) & col_ok[None, :]
                xy += tl.sum(tl.where(hit, x, 0.0), axis=1)
    out = out_ptr + split * T * 4 + rows * 4
    tl.store(out + 0, m, mask=in_range)
    tl.store(out + 1, s, mask=in_range)
    tl.store(out + 2, t, mask=in_range)
    tl.store(out + 3, xy, mask=in_range)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, y_ptr, rows_ptr, n_active_ptr, log_z_ptr, ent_ptr, g_lp_ptr, g_h_ptr, d_ptr,
                    T, col_start, vocab_start, temperature, stride_h, stride_w, stride_d,
                    Vp: tl.constexpr, H: tl.constexpr, chunk_cols: tl.constexpr,
                    BT: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    idx = pid_t * BT + tl.arange(0, BT)
    in_range = idx < T
    n_active = tl.load(n_active_ptr)
    rows = tl.load(rows_ptr + idx, mask=in_range, other=0)
    active = in_range & (idx < n_active)
    local = pid_v * BV + tl.arange(0, BV)          # column inside the chunk
    cols = col_start + local                         # column of this shard
    col_ok = (local < chunk_cols) & (cols < Vp)
    z = tl.zeros((BT, BV), dtype=tl.float32)
    if pid_t * BT < n_active:  # a block of masked rows does no matmul (and writes zeros)
        z = _logit_tile(h_ptr, w_ptr, rows, active, cols, col_ok, stride_h, stride_w, H, BT, BV, BH, PRECISION)
    log_z = tl.load(log_z_ptr + rows, mask=active, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=active, other=0.0)
    g_lp = tl.load(g_lp_ptr + rows, mask=active, other=0.0)
    g_h = tl.load(g_h_ptr + rows, mask=active, other=0.0)
    target = tl.load(y_ptr + rows, mask=active, other=-1) - vocab_start
    live = active & ((g_lp != 0.0) | (g_h != 0.0))  # rows with a gradient; the others get exact zeros
    log_p = z / temperature - log_z[:, None]
    p = tl.exp(tl.where(log_p > 0.0, 0.0, log_p))  # log p <= 0 (rounding), by selection: NaN stays NaN
    # d/dx: g_lp ([v = y] - p) - g_H p (log p + H); d/dz = d/dx / tau
    g = -p * (g_lp[:, None] + g_h[:, None] * (log_p + ent[:, None]))
    g += tl.where(cols[None, :] == target[:, None], g_lp[:, None], 0.0)
    g = tl.where(live[:, None] & col_ok[None, :], g / temperature, 0.0)
    ptrs = d_ptr + rows[:, None] * stride_d + local[None, :]
    tl.store(ptrs, g.to(d_ptr.dtype.element_ty), mask=in_range[:, None] & (local < chunk_cols)[None, :])


@triton.jit
def _dhidden_kernel(d_ptr, w_ptr, acc_ptr, out_ptr, rows_ptr, n_active_ptr, T, stride_d, stride_w, stride_acc,
                    stride_out, C: tl.constexpr, H: tl.constexpr, ACCUMULATE: tl.constexpr,
                    STORE_INACTIVE: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr,
                    PRECISION: tl.constexpr):
    """``out[r, k] = (acc[r, k] if ACCUMULATE else 0) + sum_c d[r, c] W[c, k]`` over one chunk, float32 sums.

    Rows ``r = rows[i]`` (active first); blocks past ``n_active`` do no work and store zeros only when
    ``STORE_INACTIVE`` (the first chunk, or ``out`` is not the accumulator).
    """
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    idx = pid_t * BT + tl.arange(0, BT)
    in_range = idx < T
    n_active = tl.load(n_active_ptr)
    rows = tl.load(rows_ptr + idx, mask=in_range, other=0)
    active = in_range & (idx < n_active)
    ks = pid_h * BH + tl.arange(0, BH)
    k_ok = ks < H
    out_ptrs = out_ptr + rows[:, None] * stride_out + ks[None, :]
    out_mask = in_range[:, None] & k_ok[None, :]
    if pid_t * BT < n_active:
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        if ACCUMULATE:
            acc = tl.load(acc_ptr + rows[:, None] * stride_acc + ks[None, :], mask=active[:, None] & k_ok[None, :],
                          other=0.0)
        for c0 in range(0, C, BC):
            cs = c0 + tl.arange(0, BC)
            c_ok = cs < C
            a = tl.load(d_ptr + rows[:, None] * stride_d + cs[None, :], mask=active[:, None] & c_ok[None, :],
                        other=0.0)
            b = tl.load(w_ptr + cs.to(tl.int64)[:, None] * stride_w + ks[None, :],
                        mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            if PRECISION == "ieee":
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif STORE_INACTIVE:
        tl.store(out_ptrs, tl.zeros((BT, BH), dtype=out_ptr.dtype.element_ty), mask=out_mask)


def _launch_options(hidden: torch.Tensor) -> dict:
    return CUDA_LAUNCH if hidden.is_cuda else {}


def _blocks(hidden: torch.Tensor) -> tuple[int, int, int, str]:
    """Tile sizes ``(BT, BV, BH)`` and the dot precision.

    CUDA: bf16/fp16 tiles go to the tensor cores as they are (products exact, float32 accumulation); float32
    tiles use IEEE float32, never TF32. Interpreter (CPU): tiles are upcast to float32 first (the same
    products and accumulation; triton 3.6's interpreter computes bf16 ``tl.dot`` wrongly) and are the
    smallest ``tl.dot`` shape, the fastest to interpret.
    """
    if hidden.is_cuda:
        return (*CUDA_BLOCKS, "ieee" if hidden.dtype == torch.float32 else "tf32")
    return 16, 16, 16, "ieee"


def _num_splits(hidden: torch.Tensor, n_row_blocks: int, n_tiles: int) -> int:
    """Vocabulary splits: ~4 programs per SM on CUDA (a power of two); 2 on the interpreter (tests the merge)."""
    if not hidden.is_cuda:
        return min(2, n_tiles)
    want = triton.cdiv(4 * torch.cuda.get_device_properties(hidden.device).multi_processor_count, n_row_blocks)
    return max(1, min(triton.next_power_of_2(want), n_tiles))


def stats(hidden, weight, targets, rows, n_active, vocab_start: int, temperature: float) -> torch.Tensor:
    """``[splits, T, 4]`` float32: per split and row ``(m, s, t, x_y)`` of this shard (module docstring)."""
    n_tok, h = hidden.shape
    vp = weight.shape[0]
    bt, bv, bh, precision = _blocks(hidden)
    n_tiles = triton.cdiv(vp, bv)
    splits = _num_splits(hidden, triton.cdiv(n_tok, bt), n_tiles)
    tiles_per_split = triton.cdiv(n_tiles, splits)
    splits = triton.cdiv(n_tiles, tiles_per_split)
    out = torch.empty(splits, n_tok, 4, dtype=torch.float32, device=hidden.device)
    with launching(KERNEL):
        _stats_kernel[(triton.cdiv(n_tok, bt), splits)](
            hidden, weight, targets, rows, n_active, out, n_tok, vocab_start, temperature,
            hidden.stride(0), weight.stride(0), tiles_per_split, Vp=vp, H=h, BT=bt, BV=bv, BH=bh,
            PRECISION=precision, **_launch_options(hidden))
    return out


def dlogits(hidden, weight, targets, rows, n_active, log_z, ent, g_lp, g_h, out, col_start: int,
            vocab_start: int, temperature: float) -> torch.Tensor:
    """Fill ``out [T, C]`` with ``d/dz`` of columns ``[col_start, col_start + C)``; returns ``out``."""
    n_tok, h = hidden.shape
    chunk_cols = out.shape[1]
    bt, bv, bh, precision = _blocks(hidden)
    grid = (triton.cdiv(n_tok, bt), triton.cdiv(chunk_cols, bv))
    with launching(KERNEL):
        _dlogits_kernel[grid](
            hidden, weight, targets, rows, n_active, log_z, ent, g_lp, g_h, out, n_tok, col_start, vocab_start,
            temperature, hidden.stride(0), weight.stride(0), out.stride(0), Vp=weight.shape[0], H=h,
            chunk_cols=chunk_cols, BT=bt, BV=bv, BH=bh, PRECISION=precision, **_launch_options(hidden))
    return out


def dhidden(d, w_chunk, acc, out, rows, n_active, *, accumulate: bool) -> torch.Tensor:
    """``out [T, H] = (acc if accumulate else 0) + d [T, C] @ w_chunk [C, H]`` in float32 (``out`` may be
    ``acc``); returns ``out``. Rows past the active count: zeros written only on the first chunk or when
    ``out`` is not ``acc`` (otherwise they already hold them)."""
    n_tok, chunk_cols = d.shape
    h = w_chunk.shape[1]
    bt, bh, bc, precision = _blocks(d)  # output tile [BT, BH] and reduction step BC: the logit tile's shape
    grid = (triton.cdiv(n_tok, bt), triton.cdiv(h, bh))
    with launching(KERNEL):
        _dhidden_kernel[grid](
            d, w_chunk, acc, out, rows, n_active, n_tok, d.stride(0), w_chunk.stride(0), acc.stride(0),
            out.stride(0), C=chunk_cols, H=h, ACCUMULATE=accumulate, STORE_INACTIVE=not accumulate or out is not acc,
            BT=bt, BH=bh, BC=bc, PRECISION=precision, **_launch_options(d))
    return out
