"""Token log-probs and entropies from vocab-parallel logits: the chunked torch code (the reference; memory
``O(chunk_size * V/TP)``, one all-reduce MAX of ``[T]`` and one SUM of ``[T, 3]`` over TP, no host sync) and, with
``kernels="triton"``, the Triton kernels of :mod:`slime_tis.kernels.logprobs`. Formulas and the NaN and -inf rules:
docs/kernels.md; the sampling-support replay: docs/sampling_support.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.engine.parallel import megatron_parallel_state
from slime_tis.engine.settings import CHUNK_SIZE
from slime_tis.engine.support_logprobs import SupportLogProbEntropy, check_support
from slime_tis.kernels import dispatch
from slime_tis.kernels.logprobs_torch import FMIN, finish_rows, fp32_chunk, grad_logits, target_column

__all__ = ["vocab_parallel_log_probs_and_entropy", "default_tp_group"]


def default_tp_group() -> dist.ProcessGroup | None:
    """megatron's tensor-parallel group when model parallel is initialised, else ``None`` (no TP)."""
    ps = megatron_parallel_state()
    return None if ps is None else ps.get_tensor_model_parallel_group()


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """``(logits [T, Vp], targets [T]) -> (log_probs [T], entropy [T])``, both float32."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                group: dist.ProcessGroup | None, vocab_start: int, with_entropy: bool, keep: Tensor | None):
        n_tok, vp = logits.shape
        tp = dispatch.group_size(group)
        # Global row maximum of x = z / tau (tau > 0, so max(z) / tau); detached shift, any value works.
        row_max = logits.detach().amax(dim=-1).to(torch.float32).div_(temperature) if n_tok else \
            torch.zeros(0, dtype=torch.float32, device=logits.device)
        if tp > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        safe_idx, in_shard = target_column(targets, vocab_start, vp)
        # sums[:, 0] = sum exp(x - m), sums[:, 1] = x_y (owning rank only), sums[:, 2] = sum exp(x - m)(x - m)
        sums = torch.zeros(n_tok, 3, dtype=torch.float32, device=logits.device)
        for start in range(0, n_tok, chunk_size):
            end = min(start + chunk_size, n_tok)
            y = fp32_chunk(logits, start, end, temperature)
            y.sub_(row_max[start:end, None]).clamp_(min=FMIN)     # y = x - m (-inf logits -> finite, e = 0)
            e = torch.exp(y)
            sums[start:end, 0] = e.sum(dim=-1)
            x_t = y.gather(1, safe_idx[start:end, None]).squeeze(1) + row_max[start:end]
            sums[start:end, 1] = torch.where(in_shard[start:end], x_t, torch.zeros_like(x_t))
            if with_entropy:
                sums[start:end, 2] = torch.bmm(e.unsqueeze(1), y.unsqueeze(2)).view(-1)
            del y, e
        if tp > 1:
            dist.all_reduce(sums, group=group)
        log_probs, entropy, log_z = finish_rows(row_max, sums, with_entropy, keep)
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
    """``(log_probs [...], entropy [...] or None)`` float32 of ``softmax(logits / temperature)``, differentiable w.r.t.
    ``logits [..., V/TP]`` (this TP rank's shard, any float dtype); ``targets [...]``: global ids.

    ``tp_group``: the vocabulary split (``"default"``: megatron's TP group when initialised; ``None``: no TP).
    ``row_mask [...]``: rows where it is 0 give 0 and a zero gradient (the Triton kernels skip them). ``kernels``:
    ``"torch"`` or ``"triton"`` (:mod:`slime_tis.kernels.dispatch`; ``chunk_size``: rows at a time, torch only).
    ``support``: ``(support_ids [S], support_offsets [N + 1])``, the CSR of global ids kept at each of the ``N``
    flattened rows: the log-probs and entropy of the distribution restricted to them and renormalised there
    (:mod:`slime_tis.engine.support_logprobs`). Bad arguments: ``ValueError`` naming the argument and value.
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
    temperature = dispatch.check_args(temperature, chunk_size)
    if row_mask is not None and (not isinstance(row_mask, Tensor) or tuple(row_mask.shape) != tuple(targets.shape)):
        raise ValueError(f"row_mask shape {tuple(getattr(row_mask, 'shape', ()))} must equal targets shape "
                         f"{tuple(targets.shape)}")
    kernel = dispatch.triton_module("logprobs", "slime_tis.kernels.logprobs", logits.device, kernels)
    group = default_tp_group() if isinstance(tp_group, str) and tp_group == "default" else tp_group
    vocab_start = (dist.get_rank(group) if dispatch.group_size(group) > 1 else 0) * logits.shape[-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).to(torch.int64)
    flat_mask = None if row_mask is None else row_mask.reshape(-1)
    if support is not None:
        support = check_support(support, flat_targets.numel())
    lp = ent = None
    if kernel is not None:
        try:
            args = dict(temperature=temperature, group=group, vocab_start=vocab_start, with_entropy=with_entropy,
                        row_mask=flat_mask)
            lp, ent = (kernel.fused_log_probs_and_entropy(flat_logits, flat_targets, **args) if support is None
                       else kernel.support_log_probs_and_entropy(flat_logits, flat_targets, *support, **args))
        except dispatch.KernelLaunchError as err:  # raised before any collective: the torch code runs
            dispatch.fall_back(err)
    if lp is None:
        keep = None if flat_mask is None else flat_mask != 0
        if support is None:
            lp, ent = _VocabParallelLogProbEntropy.apply(flat_logits, flat_targets, temperature, chunk_size, group,
                                                         vocab_start, with_entropy, keep)
        else:
            lp, ent = SupportLogProbEntropy.apply(flat_logits, flat_targets, *support, temperature, group,
                                                  vocab_start, with_entropy, keep)
    lead = logits.shape[:-1]
    return lp.view(lead), (ent.view(lead) if with_entropy else None)
