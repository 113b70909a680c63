"""Test-only CPU context-parallel core attention for megatron's local GPT layer spec.

The stock local spec refuses CP ("only supported by TEDotProductAttention"). This module all-gathers
K and V over the CP group (differentiable: backward = all-reduce + slice) and applies the causal mask
in global positions of megatron's load-balanced layout, where CP rank ``r`` holds sequence chunks
``r`` and ``2*cp - 1 - r`` of ``2*cp`` (``get_batch_on_this_cp_rank``). Inputs are ``[S_local, B, heads,
head_dim]`` (sbhd); one causal sequence per row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


class _AllGatherSeq(torch.autograd.Function):
    """Concatenate every CP rank's ``x`` along dim 0; backward all-reduces and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        n = grad.shape[0] // size
        return grad[rank * n:(rank + 1) * n], None


def cp_global_positions(local_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """Global positions held by ``cp_rank``: chunk ``cp_rank`` then chunk ``2*cp_size-1-cp_rank``."""
    c = local_len // 2
    idx = torch.arange(c)
    return torch.cat([cp_rank * c + idx, (2 * cp_size - 1 - cp_rank) * c + idx])


class CPUContextParallelAttention(MegatronModule):
    """Drop-in ``core_attention`` (signature of megatron's DotProductAttention) supporting CP on CPU."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs) -> None:
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        sq = query.shape[0]
        if cp > 1:
            group = ps.get_context_parallel_group()
            key, value = _AllGatherSeq.apply(key, group), _AllGatherSeq.apply(value, group)
            qpos = cp_global_positions(sq, rank, cp)
            kpos = torch.cat([cp_global_positions(sq, i, cp) for i in range(cp)])
        else:
            qpos = kpos = torch.arange(sq)
        if key.shape[2] != query.shape[2]:
            rep = query.shape[2] // key.shape[2]
            key, value = key.repeat_interleave(rep, 2), value.repeat_interleave(rep, 2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        ctx = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=qpos[:, None] >= kpos[None, :], scale=self.scale)
        return ctx.permute(2, 0, 1, 3).reshape(sq, query.shape[1], -1)
