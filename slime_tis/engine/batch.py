"""``TISBatch``: the per-micro-batch RL fields the loss hook needs, in the core's packed layout.

Every per-token field is a 1-D tensor ``[T]`` aligned with the flattened logits positions of this rank
(``logits.reshape(-1, V/TP)``, i.e. ``[B * S_local]`` row-major for a ``[B, S_local, V/TP]`` GPTModel output),
so position ``t`` holds the label predicted by the logits at ``t`` (megatron's shifted ``labels``).
``cu_seqlens [n_seq + 1]`` splits those ``T`` positions into this rank's parts of the sequences; under
context parallelism every CP rank has the same ``n_seq`` and sequence order (zero-length parts allowed),
which is what the core's ``Reducer.sequence_sum`` relies on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TISBatch", "cp_slice_padded", "cu_seqlens_from_seq_ids"]


def cp_slice_padded(x: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Megatron's load-balanced context-parallel slice of a ``[B, S, ...]`` tensor.

    The sequence dimension is cut into ``2 * cp_size`` equal chunks; rank ``r`` keeps chunks ``r`` and
    ``2 * cp_size - 1 - r`` (the layout of ``megatron.core.utils.get_batch_on_this_cp_rank``), giving
    ``[B, S / cp_size, ...]``.
    """
    if cp_size == 1:
        return x
    s = x.shape[1]
    if s % (2 * cp_size):
        raise ValueError(f"sequence length {s} must be divisible by "
                         f"2 * context_parallel_size = {2 * cp_size}")
    c = s // (2 * cp_size)
    v = x.reshape(x.shape[0], 2 * cp_size, c, *x.shape[2:])
    idx = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=x.device)
    return v.index_select(1, idx).reshape(x.shape[0], 2 * c, *x.shape[2:])


def cu_seqlens_from_seq_ids(seq_ids: Tensor, n_seq: int) -> Tensor:
    """``cu_seqlens [n_seq + 1]`` (int64) of a non-decreasing per-token sequence-id vector ``[T]``.

    ``cu[i] = #{t : seq_ids[t] < i}`` via ``searchsorted`` (vectorised; ids absent from this rank give
    zero-length sequences).
    """
    bounds = torch.arange(n_seq + 1, device=seq_ids.device, dtype=torch.int64)
    return torch.searchsorted(seq_ids.to(torch.int64).contiguous(), bounds, right=False)


@dataclass
class TISBatch:
    """RL fields of one micro-batch on this rank (packed ``[T]``, CP-local; see module docstring).

    Attributes:
        labels: ``[T]`` int64 target token ids (vocabulary ids predicted at each position).
        loss_mask: ``[T]`` bool or 0/1: 1 = trainable response token.
        advantages: ``[T]`` float advantages.
        cu_seqlens: ``[n_seq + 1]`` int sequence boundaries of this rank's tokens.
        rollout_log_probs: ``[T]`` rollout (SGLang) log-probs; required for algorithms 1-3.
        old_log_probs: ``[T]`` pi_old: computed once per rollout by ``compute_old_log_probs`` (or supplied
            by the caller); used exactly as given. ``None``: the hook recomputes it per training call
            (algorithms 0, 2; correct for one optimizer step per rollout only).
        ref_log_probs: ``[T]`` reference-policy log-probs, CP-local like the others; required by the KL term
            (``--tis-kl-coef``).
        support_ids, support_offsets: ``[S]`` int and ``[T + 1]`` int64: each position's sampling support (CSR of
            global vocabulary ids: position ``t`` keeps ``support_ids[support_offsets[t]:support_offsets[t + 1]]``;
            empty off the loss mask), for the replay of the sampled support (``--tis-sampling-support``,
            :mod:`slime_tis.engine.support_logprobs`; CP-local: :func:`~slime_tis.engine.support_logprobs.
            padded_support`). ``None``: log-probs over the full vocabulary.
        staleness: ``[n_seq]`` per-sequence staleness (policy versions between the rollout's weights and the
            trainer's), read by ``--tis-staleness-buckets`` / ``--tis-staleness-bound-decay`` (``core.staleness``).
    """

    labels: Tensor
    loss_mask: Tensor
    advantages: Tensor
    cu_seqlens: Tensor
    rollout_log_probs: Tensor | None = None
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    support_ids: Tensor | None = None
    support_offsets: Tensor | None = None
    staleness: Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("labels", "loss_mask", "advantages", "rollout_log_probs", "old_log_probs", "ref_log_probs"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, Tensor) or t.dim() != 1:
                raise ValueError(f"TISBatch.{name} must be a packed 1-D tensor [T], got "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
            if t.shape[0] != self.labels.shape[0]:
                raise ValueError(f"TISBatch length mismatch: {name} has {t.shape[0]} tokens, "
                                 f"labels has {self.labels.shape[0]}")
        if self.labels.dtype.is_floating_point or self.labels.dtype == torch.bool:
            raise ValueError(f"TISBatch.labels must hold integer token ids, got {self.labels.dtype}")
        cu = self.cu_seqlens
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError("TISBatch.cu_seqlens must be a 1-D integer tensor [n_seq + 1]")
        if (self.support_ids is None) != (self.support_offsets is None):
            raise ValueError("TISBatch.support_ids and support_offsets are given together (the CSR of the supports)")
        if self.support_ids is not None:
            from slime_tis.engine.support_logprobs import check_support

            check_support((self.support_ids, self.support_offsets), self.labels.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def to(self, device: torch.device | str) -> TISBatch:
        """A copy with every tensor moved to ``device`` (non-blocking where possible)."""
        return dataclasses.replace(self, **{
            f.name: (getattr(self, f.name).to(device, non_blocking=True) if getattr(self, f.name) is not None
                     else None) for f in dataclasses.fields(self)})

    @classmethod
    def from_padded(cls, labels: Tensor, loss_mask: Tensor, advantages: Tensor,
                    rollout_log_probs: Tensor | None = None, *, seq_ids: Tensor | None = None,
                    cp_slice: bool = True, cp_size: int | None = None, cp_rank: int | None = None,
                    ref_log_probs: Tensor | None = None) -> TISBatch:
        """Build from ``[B, S]`` tensors laid out like the model input (one row per model input row).

        Args:
            labels, loss_mask, advantages, rollout_log_probs, ref_log_probs: ``[B, S]`` (full sequence length when
                ``cp_slice``; positions with mask 0, e.g. padding and prompt, may hold any value).
            seq_ids: ``[B, S]`` int sequence index of every position, non-decreasing in row-major order,
                to pack several sequences per row (padding takes its row's last id). Default: row ``b`` is
                sequence ``b``.
            cp_slice: apply megatron's load-balanced CP slice (``cp_slice_padded``); ``False`` when the
                tensors are already CP-local.
            cp_size, cp_rank: default from ``parallel_state`` (1 and 0 when it is not initialised).
        """
        fields = {"labels": labels, "loss_mask": loss_mask, "advantages": advantages,
                  "rollout_log_probs": rollout_log_probs, "ref_log_probs": ref_log_probs, "seq_ids": seq_ids}
        for name, t in fields.items():
            if t is not None and (not isinstance(t, Tensor) or t.dim() != 2 or t.shape != labels.shape):
                got = tuple(t.shape) if isinstance(t, Tensor) else t
                raise ValueError(f"from_padded: {name} must be a [B, S] tensor shaped like labels "
                                 f"{tuple(labels.shape)}, got {got!r}")
        n_rows = labels.shape[0]
        if seq_ids is None:
            seq_ids = torch.arange(n_rows, device=labels.device)[:, None].expand(labels.shape)
            n_seq = n_rows
        else:
            flat = seq_ids.reshape(-1)
            bad = flat.numel() and (bool((flat[1:] < flat[:-1]).any()) or int(flat[0]) < 0)  # host-sync-ok
            if bad:
                raise ValueError("from_padded: seq_ids must be >= 0 and non-decreasing in row-major order")
            n_seq = int(flat.max()) + 1 if flat.numel() else 0  # host-sync-ok (batch prep)
        if cp_slice:
            if cp_size is None or cp_rank is None:
                cp_size, cp_rank = _cp_layout()
            fields = {k: (cp_slice_padded(v, cp_size, cp_rank) if v is not None else None)
                      for k, v in {**fields, "seq_ids": seq_ids}.items()}
        else:
            fields = {**fields, "seq_ids": seq_ids}
        local_ids = fields.pop("seq_ids").reshape(-1)
        return cls(labels=fields["labels"].reshape(-1).to(torch.int64),
                   loss_mask=fields["loss_mask"].reshape(-1),
                   advantages=fields["advantages"].reshape(-1),
                   cu_seqlens=cu_seqlens_from_seq_ids(local_ids, n_seq),
                   **{k: (fields[k].reshape(-1) if fields[k] is not None else None)
                      for k in ("rollout_log_probs", "ref_log_probs")})


def _cp_layout() -> tuple[int, int]:
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return 1, 0
    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
