"""Triton kernels of the fused output layer (:mod:`slime_tis.kernels.output_layer`; docs/output_layer.md), imported
on the Triton path only: ``_stats_kernel`` (per row block and vocabulary split: online ``(m, s, t, x_y)``),
``_dlogits_kernel`` (``dL/dz`` of one vocabulary chunk) and ``_dhidden_kernel`` (``dL/dh += dL/dz W_chunk`` in
float32). Rows are visited active-first (``rows``); blocks past ``n_active`` (read on the device) skip their
matmuls. Loop bounds are compile-time constants (one compilation per model; the Triton 3.6 interpreter cannot take a
runtime bound with numpy >= 2.4).
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
def _row_block(rows_ptr, n_active_ptr, T, BT: tl.constexpr):
    """This program's block of rows ``rows[i]``: ``(rows, in_range, active, busy)``; ``busy``: the block holds an
    active row (rows are ordered active-first; ``n_active`` is read on the device)."""
    first = tl.program_id(0) * BT
    idx = first + tl.arange(0, BT)
    in_range = idx < T
    n_active = tl.load(n_active_ptr)
    rows = tl.load(rows_ptr + idx, mask=in_range, other=0)
    return rows, in_range, in_range & (idx < n_active), first < n_active


@triton.jit
def _stats_kernel(h_ptr, w_ptr, y_ptr, rows_ptr, n_active_ptr, out_ptr,
                  T, vocab_start, temperature, stride_h, stride_w, tiles_per_split,
                  Vp: tl.constexpr, H: tl.constexpr,
                  BT: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr):
    split = tl.program_id(1)
    lo = split * tiles_per_split * BV
    hi = lo + tiles_per_split * BV
    rows, in_range, active, busy = _row_block(rows_ptr, n_active_ptr, T, BT)
    target = tl.load(y_ptr + rows, mask=active, other=-1) - vocab_start
    m = tl.full((BT,), _NEG, dtype=tl.float32)
    s = tl.zeros((BT,), dtype=tl.float32)
    t = tl.zeros((BT,), dtype=tl.float32)
    xy = tl.zeros((BT,), dtype=tl.float32)
    if busy:  # a block of masked rows does no work
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
    pid_v = tl.program_id(1)
    rows, in_range, active, busy = _row_block(rows_ptr, n_active_ptr, T, BT)
    local = pid_v * BV + tl.arange(0, BV)          # column inside the chunk
    cols = col_start + local                         # column of this shard
    col_ok = (local < chunk_cols) & (cols < Vp)
    z = tl.zeros((BT, BV), dtype=tl.float32)
    if busy:  # a block of masked rows does no matmul (and writes zeros)
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
    """``out[r, k] = (acc[r, k] if ACCUMULATE else 0) + sum_c d[r, c] W[c, k]`` over one chunk, float32 sums; blocks
    past ``n_active`` store zeros only when ``STORE_INACTIVE``."""
    pid_h = tl.program_id(1)
    rows, in_range, active, busy = _row_block(rows_ptr, n_active_ptr, T, BT)
    ks = pid_h * BH + tl.arange(0, BH)
    k_ok = ks < H
    out_ptrs = out_ptr + rows[:, None] * stride_out + ks[None, :]
    out_mask = in_range[:, None] & k_ok[None, :]
    if busy:
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


def _blocks(hidden: torch.Tensor) -> tuple[int, int, int, str]:
    """Tile sizes ``(BT, BV, BH)`` and the dot precision: on CUDA bf16/fp16 tiles as they are, float32 tiles in IEEE
    float32 (never TF32); on the interpreter the smallest tiles, upcast to float32 (its bf16 ``tl.dot`` is wrong)."""
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
    """``[splits, T, 4]`` float32: per split and row ``(m, s, t, x_y)`` of this shard."""
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
            PRECISION=precision, **(CUDA_LAUNCH if hidden.is_cuda else {}))
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
            chunk_cols=chunk_cols, BT=bt, BV=bv, BH=bh, PRECISION=precision,
            **(CUDA_LAUNCH if hidden.is_cuda else {}))
    return out


def dhidden(d, w_chunk, acc, out, rows, n_active, *, accumulate: bool) -> torch.Tensor:
    """``out [T, H] = (acc if accumulate else 0) + d [T, C] @ w_chunk [C, H]`` in float32 (``out`` may be ``acc``)."""
    n_tok, chunk_cols = d.shape
    h = w_chunk.shape[1]
    bt, bh, bc, precision = _blocks(d)  # output tile [BT, BH] and reduction step BC: the logit tile's shape
    grid = (triton.cdiv(n_tok, bt), triton.cdiv(h, bh))
    with launching(KERNEL):
        _dhidden_kernel[grid](
            d, w_chunk, acc, out, rows, n_active, n_tok, d.stride(0), w_chunk.stride(0), acc.stride(0),
            out.stride(0), C=chunk_cols, H=h, ACCUMULATE=accumulate, STORE_INACTIVE=not accumulate or out is not acc,
            BT=bt, BH=bh, BC=bc, PRECISION=precision, **(CUDA_LAUNCH if d.is_cuda else {}))
    return out
