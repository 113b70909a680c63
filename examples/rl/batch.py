"""From SGLang-shaped responses to the padded training batch the megatron hook consumes.

One code path for every backend (embedded engine, HTTP server, real SGLang): the responses are parsed by
:func:`parse_responses` (token ids are taken from ``output_token_logprobs``, never re-tokenised), rewards
are computed by the task, GRPO advantages per prompt group, and everything is laid out as ``[N, S]``
right-padded rows (``N`` sequences, ``S = prompt + max_new_tokens``).

Row layout, for sequence ``i`` with prompt length ``P`` and ``R_i`` response tokens::

    tokens[i]        = prompt (P) | response (R_i) | pad (0)
    labels[i, s]     = tokens[i, s + 1]                       (Megatron "labels": token predicted at s)
    loss_mask[i, s]  = 1  iff  P - 1 <= s < P - 1 + R_i        (positions that predict a response token)
    rollout_lp[i, s] = SGLang log-prob of labels[i, s] where loss_mask, else 0
    advantages[i, s] = A_i (GRPO, broadcast over the row)
    routed_experts[i, s] = experts the engine routed input token s to, [num_layers, k]  (MoE + replay only;
                       -1 where the engine did not run the token: the last response token and padding)
    support_lengths[i, s] = how many ids the engine kept when it sampled labels[i, s] (0 off the loss mask), and
    support_ids[i]        = those ids, position after position, padded with -1   (sampling-support replay only)
    rollout_log_mass[i, s] = log of the mass the engine's top-p / top-k kept when it sampled labels[i, s] (0 off
                       the loss mask; with the supports)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from examples.rl.task import DigitTask


@dataclass
class RolloutBatch:
    """A step's global batch (identical on every rank after the broadcast).

    tokens, labels: ``[N, S]`` int64; loss_mask: ``[N, S]`` bool; rollout_log_probs, advantages: ``[N, S]``
    float32; rewards, response_lengths, sglang_rejected: ``[N]``; prompts: ``[N, P]`` int64; routed_experts:
    ``[N, S, num_layers, k]`` int64 or ``None`` (only when the engine was asked for them); support_lengths ``[N, S]``
    int64 and support_ids ``[N, L]`` int32 (padded with -1) or ``None``: the sampling supports; rollout_log_mass
    ``[N, S]`` float32 or ``None`` (module docstring).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    response_lengths: torch.Tensor
    prompts: torch.Tensor
    sglang_rejected: torch.Tensor
    routed_experts: torch.Tensor | None = None
    support_lengths: torch.Tensor | None = None
    support_ids: torch.Tensor | None = None
    rollout_log_mass: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def rows(self, start: int, stop: int) -> RolloutBatch:
        """Sequences ``start:stop`` (a data-parallel shard or a micro-batch)."""
        return RolloutBatch(
            **{k: None if getattr(self, k) is None else getattr(self, k)[start:stop] for k in self.__dataclass_fields__}
        )

    def to_payload(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_payload(cls, payload: dict[str, torch.Tensor]) -> RolloutBatch:
        return cls(**payload)


def parse_responses(responses: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
                    support_vocab_size: int | None = None) -> Any:
    """Parse ``/generate`` responses with the plugin's SGLang parser into a packed
    :class:`slime_tis.sglang.PackedRollouts` (token ids from ``output_token_logprobs``; misaligned or
    non-finite responses are marked rejected and counted in ``sglang/*`` metrics, never silently used).

    ``support_vocab_size``: the responses carry SGLang's sampling supports (``return_sampling_mask``): pi_rollout
    is ``output_token_sampling_logprobs`` (the truncated distribution's) and the supports are parsed and validated
    against this vocabulary size; ``None``: pi_rollout is ``output_token_logprobs``."""
    from slime_tis.sglang import collate, parse_generate_response

    replay = support_vocab_size is not None
    if sampling_params is not None:
        from slime_tis.sglang import check_sampling_params

        # warns once about the top-p / top-k log-prob bias, unless the truncated log-probs are used
        check_sampling_params(sampling_params, renormalized_logprobs=True if replay else None)
    if not replay:
        return collate([parse_generate_response(r) for r in responses])
    return collate([parse_generate_response(r, rollout_logprobs="sampling", sampling_support=True,
                                            vocab_size=support_vocab_size) for r in responses])


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages ``[N]`` for rewards ``[N]`` laid out as consecutive groups of ``group_size``:
    ``A_i = (r_i - mean_g) / (std_g + eps)`` (population std; ``std_normalize=False``: ``r_i - mean_g``)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.reshape(-1)


def routed_experts_rows(responses: list[dict[str, Any]], seq_len: int, num_layers: int, topk: int) -> torch.Tensor:
    """The engine's experts per input position, ``[N, seq_len, num_layers, topk]`` (``-1`` past what the
    engine ran), from each response's ``meta_info.routed_experts`` (``prompt + completion - 1`` positions)."""
    from examples.rl.rollout_engine import decode_routed_experts

    out = torch.full((len(responses), seq_len, num_layers, topk), -1, dtype=torch.long)
    for i, r in enumerate(responses):  # host data (response parsing)
        meta = r.get("meta_info") if isinstance(r, dict) else None
        data = meta.get("routed_experts") if isinstance(meta, dict) else None
        if not isinstance(data, str):
            raise ValueError(
                f"response {i} has no meta_info.routed_experts (ask with return_routed_experts=true "
                "from a mixture-of-experts engine)"
            )
        experts = decode_routed_experts(data, num_layers, topk)
        expected = meta.get("prompt_tokens", 0) + meta.get("completion_tokens", 0) - 1
        if experts.shape[0] != expected or expected > seq_len:
            raise ValueError(
                f"response {i}: routed_experts covers {experts.shape[0]} positions, expected "
                f"prompt_tokens + completion_tokens - 1 = {expected} (at most {seq_len})"
            )
        out[i, : experts.shape[0]] = experts
    return out


def build_batch(
    task: DigitTask,
    prompts: torch.Tensor,
    packed: Any,
    group_size: int,
    *,
    std_normalize: bool = True,
    routed_experts: torch.Tensor | None = None,
) -> RolloutBatch:
    """Lay out parsed responses (``PackedRollouts`` with ``n`` sequences) for ``prompts [n, P]`` (each
    prompt repeated ``group_size`` times consecutively); ``routed_experts`` (:func:`routed_experts_rows`) is
    carried as is."""
    n, plen = prompts.shape
    cu = packed.cu_seqlens
    if cu.numel() - 1 != n:
        raise ValueError(f"got {cu.numel() - 1} parsed responses for {n} prompts")
    lengths = (cu[1:] - cu[:-1]).long()
    rmax = task.max_new_tokens
    if int(lengths.max()) > rmax:  # host-sync-ok (input validation, outside the loss)
        raise ValueError(f"a response has {int(lengths.max())} tokens, more than max_new_tokens={rmax}")
    seq_len = plen + rmax
    # scatter the packed [T] response tensors into [n, rmax] (vectorised)
    seq_id = torch.repeat_interleave(torch.arange(n), lengths)
    offset = torch.arange(cu[-1]) - cu[:-1].repeat_interleave(lengths)
    resp = torch.zeros(n, rmax, dtype=torch.long)
    resp_lp = torch.zeros(n, rmax, dtype=torch.float32)
    resp_mask = torch.zeros(n, rmax, dtype=torch.bool)
    resp[seq_id, offset] = packed.token_ids.long()
    resp_lp[seq_id, offset] = packed.rollout_log_probs.float()
    resp_mask[seq_id, offset] = packed.loss_mask > 0
    tokens = torch.cat([prompts, resp], dim=1)
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    loss_mask = torch.zeros(n, seq_len, dtype=torch.bool)
    loss_mask[:, plen - 1 : plen - 1 + rmax] = resp_mask
    rollout_lp = torch.zeros(n, seq_len, dtype=torch.float32)
    rollout_lp[:, plen - 1 : plen - 1 + rmax] = resp_lp
    responses = [t.tolist() for t in packed.token_ids.split(lengths.tolist())]  # host data for the reward
    rewards = task.rewards(prompts, responses)
    adv = grpo_advantages(rewards, group_size, std_normalize=std_normalize)
    support_lengths = support_ids = log_mass = None
    if packed.support_offsets is not None:
        support_lengths, support_ids = _support_rows(packed, seq_id, offset, n, plen, rmax)
    if packed.rollout_log_mass is not None:
        log_mass = torch.zeros(n, seq_len, dtype=torch.float32)
        log_mass[seq_id, plen - 1 + offset] = packed.rollout_log_mass.float()
    return RolloutBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        rollout_log_probs=rollout_lp,
        advantages=adv.view(-1, 1).expand(n, seq_len).contiguous(),
        rewards=rewards,
        response_lengths=lengths,
        prompts=prompts,
        sglang_rejected=packed.rejected.float(),
        routed_experts=routed_experts,
        support_lengths=support_lengths,
        support_ids=support_ids,
        rollout_log_mass=log_mass,
    )


def _support_rows(packed: Any, seq_id: torch.Tensor, offset: torch.Tensor, n: int, plen: int,
                  rmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed CSR supports laid out per sequence: ``lengths [n, P + rmax]`` (at the positions that predict
    each response token) and ``ids [n, L]`` (sequence ``i``'s ids in position order, padded with -1)."""
    per_token = packed.support_offsets[1:] - packed.support_offsets[:-1]
    lengths = torch.zeros(n, plen + rmax, dtype=torch.int64)
    lengths[seq_id, plen - 1 + offset] = per_token
    per_seq = lengths.sum(dim=1)
    ids = torch.full((n, int(per_seq.max()) if n else 0), -1, dtype=torch.int32)  # host-sync-ok (data prep)
    id_seq = torch.repeat_interleave(seq_id, per_token)
    seq_start = torch.zeros(n + 1, dtype=torch.int64)
    seq_start[1:] = torch.cumsum(per_seq, 0)
    ids[id_seq, torch.arange(id_seq.numel()) - seq_start[id_seq]] = packed.support_ids
    return lengths, ids


def support_csr(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's supports as the CSR the log-prob pass reads over its ``[N * S]`` positions:
    ``(ids [S_total] int32, offsets [N * S + 1] int64)``."""
    lengths = batch.support_lengths.reshape(-1)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    offsets[1:] = torch.cumsum(lengths, 0)
    used = torch.arange(batch.support_ids.shape[1], device=lengths.device) < batch.support_lengths.sum(1, keepdim=True)
    return batch.support_ids[used], offsets
