"""Fused output layer: token log-probs and entropies straight from the hidden states and this TP rank's output
weight shard, logits never stored (one ``[T, chunk]`` tile at a time, float32 accumulation, online log-sum-exp; the
same two collectives as the log-probs from logits). The torch code here is the reference; ``kernels="triton"`` runs
:mod:`slime_tis.kernels._output_layer_triton` with the torch code as fallback. Formulas, memory, masked and
non-finite rows: docs/output_layer.md; the backward's traffic: docs/kernels.md.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.kernels import dispatch
from slime_tis.kernels.logprobs_torch import combine_partials, target_column

__all__ = ["fused_log_probs_and_entropy", "check_inputs", "mm_f32", "has_mm_out_dtype", "HALF", "CHUNK_COLUMNS"]

_NEG = -1.0e30  # finite "minus infinity" (see _output_layer_triton)
_TRITON = "slime_tis.kernels._output_layer_triton"
HALF = (torch.bfloat16, torch.float16)
#: vocabulary columns (rows of the output weight) per chunk: the one default of the output-layer paths
CHUNK_COLUMNS = 8192


# ------------------------------------------------------------------------------------------------ torch backend
@functools.cache
def has_mm_out_dtype(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for bf16 operands on this device type."""
    try:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (NotImplementedError, RuntimeError, TypeError):
        return False


def mm_f32(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a [M, K] @ b [K, N]`` as float32 ``[M, N]`` (into ``out`` when given): bf16 / fp16 operands of one dtype in
    one GEMM with float32 output where the device has it (exact products, no float32 copies, no TF32), else the
    float32 GEMM of the (exactly) upcast operands."""
    if a.dtype == b.dtype and a.dtype in HALF and has_mm_out_dtype(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def _torch_stats(hidden, weight, targets, active, vocab_start, temperature, chunk) -> Tensor:
    """``[T, 4]`` float32 ``(m, s, t, x_y)`` of this shard, vocabulary chunk by chunk (online LSE)."""
    n_tok, vp = hidden.shape[0], weight.shape[0]
    m = torch.full((n_tok,), _NEG, dtype=torch.float32, device=hidden.device)
    s = torch.zeros(n_tok, dtype=torch.float32, device=hidden.device)
    t = torch.zeros_like(s)
    xy = torch.zeros_like(s)
    for c0 in range(0, vp, chunk):
        c1 = min(c0 + chunk, vp)
        x = mm_f32(hidden, weight[c0:c1].t()).div_(temperature)  # x = h W[c0:c1]^T / tau, float32 [T, c1 - c0]
        m_new = torch.maximum(m, x.amax(dim=1))
        alpha = torch.exp(m - m_new)
        d = x - m_new[:, None]
        e = torch.exp(d)
        t = alpha * (t + (m - m_new) * s) + (e * d).sum(dim=1)
        s = alpha * s + e.sum(dim=1)
        m = m_new
        idx, in_chunk = target_column(targets, vocab_start + c0, c1 - c0)
        xy = xy + torch.where(in_chunk, x.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(xy))
    out = torch.stack([m, s, t, xy], dim=1)
    return torch.where(active[:, None], out, torch.zeros_like(out))


def _torch_dlogits(hidden, weight, targets, live, log_z, ent, g_lp, g_h, out, c0, vocab_start, temperature):
    """``out [T, C] = dL/dz`` for shard columns ``[c0, c0 + C)`` (exact zeros on rows that are not ``live``)."""
    c1 = c0 + out.shape[1]
    log_p = mm_f32(hidden, weight[c0:c1].t()).div_(temperature).sub_(log_z[:, None]).clamp_(max=0.0)
    g = -torch.exp(log_p) * (g_lp[:, None] + g_h[:, None] * (log_p + ent[:, None]))
    idx, in_chunk = target_column(targets, vocab_start + c0, c1 - c0)
    g.scatter_add_(1, idx[:, None], torch.where(in_chunk, g_lp, torch.zeros_like(g_lp))[:, None])
    g = torch.where(live[:, None], g / temperature, torch.zeros_like(g))
    out.copy_(g)
    return out


def _torch_dhidden(d: Tensor, w_chunk: Tensor, acc: Tensor, out: Tensor, *, accumulate: bool) -> Tensor:
    """``out = (acc if accumulate else 0) + d @ w_chunk``, float32 products and sums (``mm_f32``: no rounding
    between chunks); ``out`` is ``acc``, or the last chunk's result in the hidden dtype (one rounding)."""
    product = mm_f32(d, w_chunk)
    return torch.add(acc, product, out=out) if accumulate else out.copy_(product)


# ------------------------------------------------------------------------------------------------ autograd
def check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, loss_mask: Tensor | None, temperature: object,
                 chunk_size: object, tp_group: object) -> float:
    """``float(temperature)``, or ``ValueError`` naming the argument of the output layer that is wrong."""
    if not isinstance(hidden, Tensor) or hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
            or hidden.dim() < 1:
        raise ValueError(f"hidden must be a float32/bfloat16/float16 tensor [..., H], got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)} {tuple(getattr(hidden, 'shape', ()))}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V/TP, H={hidden.shape[-1]}], got {tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, "
                         f"{hidden.device})")
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor of token ids, got {getattr(targets, 'dtype', targets)}")
    lead = tuple(hidden.shape[:-1])
    if tuple(targets.shape) != lead:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden shape without H {lead}")
    if loss_mask is not None and (not isinstance(loss_mask, Tensor) or tuple(loss_mask.shape) != lead):
        raise ValueError(f"loss_mask must be a tensor of shape {lead}, got {tuple(getattr(loss_mask, 'shape', ()))}")
    if tp_group is not None and not (dist.is_available() and isinstance(tp_group, dist.ProcessGroup)):
        raise ValueError(f"tp_group must be a torch.distributed process group or None, got {tp_group!r}")
    return dispatch.check_args(temperature, chunk_size)


def _merge_splits(parts: Tensor) -> Tensor:
    """``[S, T, 4]`` statistics of disjoint vocabulary splits -> ``[T, 4]`` of their union (same rescaling)."""
    m, s, t, xy = parts.unbind(2)
    big_m = m.amax(dim=0)
    scale = torch.exp(m - big_m)
    return torch.stack([big_m, (scale * s).sum(0), (scale * (t + (m - big_m) * s)).sum(0), xy.sum(0)], dim=1)


class _FusedOutputLayer(torch.autograd.Function):
    """``(hidden [T, H], weight [Vp, H]) -> (log_probs [T], entropy [T])`` float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, active, temperature, group, vocab_start, tk, chunk,
                reduce_hidden_grad):
        local = rows = n_active = None
        if tk is not None:  # the Triton kernels (module _output_layer_triton)
            # Active rows first (stable: the order among them is kept), no host sync.
            rows = torch.argsort((~active).to(torch.int8), stable=True)
            n_active = active.sum(dtype=torch.int32)
            try:
                local = _merge_splits(tk.stats(hidden, weight, targets, rows, n_active, vocab_start, temperature))
            except dispatch.KernelLaunchError as err:  # before any collective: the torch code instead
                dispatch.fall_back(err)
                tk = rows = n_active = None
        if local is None:
            local = _torch_stats(hidden, weight, targets, active, vocab_start, temperature, chunk)
        m, s, t, xy = local.unbind(1)  # global (lp, H, logZ), zero on inactive rows (their statistics are zeros)
        lp, ent, log_z = (torch.where(active, v, torch.zeros_like(v)) for v in combine_partials(m, s, xy, t, group))
        ctx.save_for_backward(hidden, weight, targets, active, log_z, ent, rows, n_active)
        ctx.cfg = (temperature, group, vocab_start, tk, chunk, reduce_hidden_grad)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, targets, active, log_z, ent, rows, n_active = ctx.saved_tensors
        temperature, group, vocab_start, tk, chunk, reduce_hidden_grad = ctx.cfg
        zeros = torch.zeros_like(log_z)
        g_lp = zeros if grad_lp is None else grad_lp.float().contiguous()
        g_h = zeros if grad_ent is None else grad_ent.float().contiguous()
        n_tok, vp = hidden.shape[0], weight.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Rows with a gradient: active and a nonzero upstream gradient (the loss gives a rejected token none).
        # The others get exact zeros by selection, so a non-finite row puts no NaN into either gradient.
        live = active & ((g_lp != 0) | (g_h != 0))
        reduce = want_h and reduce_hidden_grad and dispatch.group_size(group) > 1
        # dL/dh: a float32 accumulator; the last chunk stores the result in hidden's dtype unless the float32
        # sum still has to be all-reduced over TP
        acc = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_hidden = acc if not want_h or reduce or hidden.dtype == torch.float32 else torch.empty_like(hidden)
        grad_weight = torch.empty_like(weight) if want_w else None
        h_live = torch.where(live[:, None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device)) \
            if want_w else None   # dL/dW = dL/dz^T h over the live rows only (no 0 * NaN)
        buf = torch.empty(n_tok, min(chunk, vp), dtype=hidden.dtype, device=hidden.device)
        starts = range(0, vp, chunk)
        for i, c0 in enumerate(starts):
            c1 = min(c0 + chunk, vp)
            d = buf[:, : c1 - c0]
            out = grad_hidden if i == len(starts) - 1 else acc
            done = False  # dL/dz of this chunk; a kernel failure switches to the torch code from there on
            if tk is not None:
                try:
                    tk.dlogits(hidden, weight, targets, rows, n_active, log_z, ent, g_lp, g_h, d, c0, vocab_start,
                               temperature)
                    done = True
                    if want_h:
                        tk.dhidden(d, weight[c0:c1], acc, out, rows, n_active, accumulate=i > 0)
                except dispatch.KernelLaunchError as err:
                    dispatch.fall_back(err)
                    tk = None
            if not done:
                _torch_dlogits(hidden, weight, targets, live, log_z, ent, g_lp, g_h, d, c0, vocab_start,
                               temperature)
            if tk is None and want_h:
                _torch_dhidden(d, weight[c0:c1], acc, out, accumulate=i > 0)
            if want_w:
                torch.mm(d.t(), h_live, out=grad_weight[c0:c1])
        if want_h and not starts:  # an empty vocabulary shard
            grad_hidden.zero_()
        if reduce:
            dist.all_reduce(acc, group=group)
            grad_hidden = acc.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def fused_log_probs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    loss_mask: Tensor | None = None,
    tp_group=None,
    reduce_hidden_grad: bool = True,
    kernels: str = dispatch.DEFAULT_KERNELS,
    chunk_size: int = CHUNK_COLUMNS,
) -> tuple[Tensor, Tensor]:
    """``(log_probs [...], entropy [...])`` float32 of ``softmax(hidden @ weight^T / temperature)``, differentiable
    w.r.t. ``hidden [..., H]`` and ``weight [V/TP, H]`` (this TP rank's shard, same dtype: float32 / bf16 / fp16;
    tied embeddings: the embedding weight). ``targets [...]``: global ids; ``loss_mask [...]``: rows where it is 0
    give 0 and zero gradients (no matmul on the Triton path); ``tp_group``: the vocabulary split (``None``: no TP);
    ``reduce_hidden_grad``: all-reduce ``dL/dhidden`` over it here (False where the caller's TP region does,
    :mod:`slime_tis.megatron.output_layer`); ``chunk_size``: vocabulary columns per chunk.
    """
    temperature = check_inputs(hidden, weight, targets, loss_mask, temperature, chunk_size, tp_group)
    tk = dispatch.triton_module("output_layer", _TRITON, hidden.device, dispatch.check_kernels(kernels))
    tp_rank = dist.get_rank(tp_group) if dispatch.group_size(tp_group) > 1 else 0
    flat_h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    flat_y = targets.reshape(-1).to(torch.int64)
    active = (torch.ones_like(flat_y, dtype=torch.bool) if loss_mask is None
              else loss_mask.reshape(-1).to(flat_y.device) != 0)
    lp, ent = _FusedOutputLayer.apply(flat_h, weight.contiguous(), flat_y, active, temperature, tp_group,
                                      tp_rank * weight.shape[0], tk, chunk_size, bool(reduce_hidden_grad))
    return lp.view(targets.shape), ent.view(targets.shape)
