"""Token log-probabilities and entropies from vocab-parallel logits, chunked and memory-bounded.

Tensor-parallel rank ``r`` of ``P`` holds the logit columns of vocabulary ids ``[r*Vp, (r+1)*Vp)``
(megatron's vocab-parallel output layer, ``parallel_output=True``). For each position with logits
``z`` (global vocabulary ``V = P*Vp``), training temperature ``tau`` and target id ``y``:

    x      = z / tau                                 (float32)
    logZ   = m + log(sum_v exp(x_v - m)),  m = max_v x_v      (max and sum all-reduced over TP)
    lp     = x_y - logZ                              (x_y all-reduced: only the owning rank adds it)
    Ex     = sum_v p_v x_v,  p_v = exp(x_v - logZ)
    H      = logZ - Ex                               (entropy of softmax(x))

Backward (no communication; ``logZ`` and ``H`` are global and saved):

    d lp / d x_v = [v = y] - p_v
    d H  / d x_v = -p_v (x_v - Ex) = -p_v (x_v - logZ + H)
    d / d z      = (d / d x) / tau

Memory: the forward keeps only ``[T]`` vectors; both passes walk ``chunk_size`` rows at a time, so the
extra peak is ``O(chunk_size * Vp)`` float32 (two temporaries) instead of the ``O(T * V)`` of
``log_softmax(z).gather(...)``. Gradients flow to the logits only (targets are integer ids).

Communication per call: one all-reduce MAX of ``[T]`` and one all-reduce SUM of ``[T, 3]`` over the TP
group (none when the group has one rank). No host synchronisation.

Two implementations of the same function (``kernels``): this chunked torch code (the reference and the
default) and, with ``kernels="triton"``, the fused Triton kernels of :mod:`slime_tis.kernels.logprobs` (one
read of the logits forward, one read and one write backward, no ``[T, V]`` temporaries besides the
gradient; rows outside ``row_mask`` are skipped), which fall back to this code with one warning where they
cannot run (:mod:`slime_tis.kernels.dispatch`). In the backward, ``log p`` is clamped at -200 (``p`` is
exactly 0 in float32 below about -104) so that a -inf logit gives a zero gradient for any upstream
gradient, and rows whose upstream gradients are both 0 (masked, rejected) get exact zeros (no ``0 * NaN``).
A NaN logit makes its row's log-prob and entropy NaN (the core then rejects the sequence).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.engine.settings import CHUNK_SIZE
from slime_tis.engine.support_logprobs import SupportLogProbEntropy, check_support
from slime_tis.kernels import dispatch
from slime_tis.kernels.logprobs_torch import fp32_chunk, grad_logits

__all__ = ["vocab_parallel_log_probs_and_entropy", "default_tp_group"]


_FMIN = torch.finfo(torch.float32).min


def default_tp_group() -> dist.ProcessGroup | None:
    """megatron's tensor-parallel group when model parallel is initialised, else ``None`` (no TP)."""
    try:
        from megatron.core import parallel_state
    except ImportError:  # megatron-core is optional for this function
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """``(logits [T, Vp], targets [T]) -> (log_probs [T], entropy [T])``, both float32."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                group: dist.ProcessGroup | None, vocab_start: int, with_entropy: bool, keep: Tensor | None):
        n_tok, vp = logits.shape
        tp = _group_size(group)
        # Global row maximum of x = z / tau (tau > 0, so max(z) / tau); detached shift, any value works.
        row_max = logits.detach().amax(dim=-1).to(torch.float32).div_(temperature) if n_tok else \
            torch.zeros(0, dtype=torch.float32, device=logits.device)
        if tp > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        local_idx = targets - vocab_start
        in_shard = (local_idx >= 0) & (local_idx < vp)
        safe_idx = torch.where(in_shard, local_idx, torch.zeros_like(local_idx))
        # sums[:, 0] = sum exp(x - m), sums[:, 1] = x_y (owning rank only), sums[:, 2] = sum exp(x - m)(x - m)
        sums = torch.zeros(n_tok, 3, dtype=torch.float32, device=logits.device)
        for start in range(0, n_tok, chunk_size):
            end = min(start + chunk_size, n_tok)
            y = fp32_chunk(logits, start, end, temperature)
            y.sub_(row_max[start:end, None]).clamp_(min=_FMIN)     # y = x - m (-inf logits -> finite, e = 0)
            e = torch.exp(y)
            sums[start:end, 0] = e.sum(dim=-1)
            x_t = y.gather(1, safe_idx[start:end, None]).squeeze(1) + row_max[start:end]
            sums[start:end, 1] = torch.where(in_shard[start:end], x_t, torch.zeros_like(x_t))
            if with_entropy:
                sums[start:end, 2] = torch.bmm(e.unsqueeze(1), y.unsqueeze(2)).view(-1)
            del y, e
        if tp > 1:
            dist.all_reduce(sums, group=group)
        sum_exp = sums[:, 0]
        log_z = row_max + torch.log(sum_exp)
        log_probs = sums[:, 1] - log_z
        if with_entropy:
            # H = logZ - Ex = log(s) - sum e (x - m) / s
            entropy = torch.log(sum_exp) - sums[:, 2] / sum_exp
        else:
            entropy = torch.zeros_like(log_probs)
        if keep is not None:  # rows outside the mask: 0 (whatever their logits hold), zero gradient rows
            log_probs = torch.where(keep, log_probs, 0.0)
            entropy = torch.where(keep, entropy, 0.0)
        ctx.save_for_backward(logits, safe_idx, in_shard, log_z, entropy, keep)
        ctx.set_materialize_grads(False)  # an unused output (entropy for metrics only) costs no backward work
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_h: Tensor | None):
        logits, safe_idx, in_shard, log_z, entropy, keep = ctx.saved_tensors
        grad = grad_logits(logits, safe_idx, in_shard, log_z, entropy, keep, grad_lp, grad_h,
                           temperature=ctx.temperature, chunk_size=ctx.chunk_size, with_entropy=ctx.with_entropy)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_log_probs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = CHUNK_SIZE,
    tp_group: dist.ProcessGroup | None | str = "default",
    with_entropy: bool = True,
    row_mask: Tensor | None = None,
    kernels: str = dispatch.DEFAULT_KERNELS,
    support: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``targets`` and entropy of ``softmax(logits / temperature)`` over the full vocabulary, or
    restricted to each position's sampling support and renormalised there (``support``).

    Args:
        logits: ``[..., V/TP]`` this TP rank's vocabulary shard (any float dtype; computed in float32).
        targets: ``[...]`` global vocabulary ids (int), same leading shape as ``logits``.
        temperature: rollout sampling temperature (> 0); training logits are divided by it first.
        chunk_size: rows processed at once; peak extra memory ~ ``2 * chunk_size * V/TP * 4`` bytes.
        tp_group: process group across which the vocabulary is split. ``"default"``: megatron's TP group
            when model parallel is initialised, else no TP. ``None``: no TP (full vocabulary here).
        with_entropy: also return the entropy (``None`` otherwise).
        row_mask: optional ``[...]`` (same shape as ``targets``; bool or numbers, nonzero = keep). Rows where
            it is 0 get log-prob and entropy 0 and a zero gradient; the Triton kernels skip them entirely
            (pass the loss mask so the cost follows the response tokens, not the sequence length).
        kernels: ``"torch"`` (default: this chunked reference) or ``"triton"`` (the fused kernels on CUDA
            tensors, or CPU under ``TRITON_INTERPRET=1``; where they cannot run, this torch code with one
            warning: ``slime_tis.kernels.dispatch``). ``chunk_size`` applies to the torch code only.
        support: ``(support_ids [S], support_offsets [N + 1])`` over the ``N`` flattened rows (CSR of global
            vocabulary ids, row ``n`` keeps ``support_ids[support_offsets[n]:support_offsets[n + 1]]``): the
            replay of the sampled support (:mod:`slime_tis.engine.support_logprobs`: the same two all-reduces,
            memory ``O(S)``, gradients through the kept logits only; ``kernels="triton"``:
            :mod:`slime_tis.kernels.logprobs_support`; ``chunk_size`` unused).

    Returns:
        ``(log_probs [...], entropy [...] or None)``, float32, differentiable with respect to ``logits``.

    Raises:
        ValueError: on bad shapes, dtypes, temperature or chunk size (naming the argument and value).
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError(f"logits must be a floating tensor [..., V/TP], got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor of token ids, "
                         f"got {getattr(targets, 'dtype', targets)}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits shape without the vocab "
                         f"dim {tuple(logits.shape[:-1])}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    dispatch.check_kernels(kernels)
    if row_mask is not None and (not isinstance(row_mask, Tensor) or tuple(row_mask.shape) != tuple(targets.shape)):
        raise ValueError(f"row_mask shape {tuple(getattr(row_mask, 'shape', ()))} must equal targets shape "
                         f"{tuple(targets.shape)}")
    triton_kernels = None if support is not None else \
        dispatch.triton_module("logprobs", "slime_tis.kernels.logprobs", logits.device, kernels)
    group = default_tp_group() if isinstance(tp_group, str) and tp_group == "default" else tp_group
    tp_rank = dist.get_rank(group) if _group_size(group) > 1 else 0
    lead = logits.shape[:-1]
    vp = logits.shape[-1]
    flat_logits = logits.reshape(-1, vp)
    flat_targets = targets.reshape(-1).to(torch.int64)
    flat_mask = None if row_mask is None else row_mask.reshape(-1)
    lp = ent = None
    if support is not None:
        ids, offsets = check_support(support, flat_targets.numel())
        support_kernels = dispatch.triton_module("logprobs", "slime_tis.kernels.logprobs", logits.device,
                                                 kernels)
        if support_kernels is not None:
            try:
                lp, ent = support_kernels.support_log_probs_and_entropy(
                    flat_logits, flat_targets, ids, offsets, temperature=float(temperature), group=group,
                    vocab_start=tp_rank * vp, with_entropy=with_entropy, row_mask=flat_mask)
            except dispatch.KernelLaunchError as err:  # raised before any collective: the torch replay runs
                dispatch.fall_back(err)
        if lp is None:
            keep = None if flat_mask is None else flat_mask != 0
            lp, ent = SupportLogProbEntropy.apply(flat_logits, flat_targets, ids, offsets, float(temperature), group,
                                                  tp_rank * vp, with_entropy, keep)
        return lp.view(lead), (ent.view(lead) if with_entropy else None)
    if triton_kernels is not None:
        try:
            lp, ent = triton_kernels.fused_log_probs_and_entropy(
                flat_logits, flat_targets, temperature=float(temperature), group=group, vocab_start=tp_rank * vp,
                with_entropy=with_entropy, row_mask=flat_mask)
        except dispatch.KernelLaunchError as err:  # raised before any collective: the torch code below runs
            dispatch.fall_back(err)
    if lp is None:
        keep = None if flat_mask is None else flat_mask != 0
        lp, ent = _VocabParallelLogProbEntropy.apply(
            flat_logits, flat_targets, float(temperature), chunk_size, group, tp_rank * vp, with_entropy, keep
        )
    return lp.view(lead), (ent.view(lead) if with_entropy else None)
