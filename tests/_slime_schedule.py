"""slime's per-rollout data-parallel / micro-batch schedule, re-stated for the tests.

What slime 624b824 (THUDM/slime, ``build_dp_schedule`` in ``slime/utils/dp_schedule.py``, with
``first_fit_pack`` / ``expand_bins_by_splitting`` of ``slime/utils/seqlen_balancing.py``) does, written
here in our own words so that the tests pack agentic rollouts the way slime does:

1. Rollouts are taken in order of their first sample; every ``global_batch_size`` rollouts form one
   optimizer step (trailing rollouts that do not fill a step are dropped). All samples of a rollout stay
   in its step.
2. A step's samples (rollout by rollout, each rollout's samples in batch order) are cut into micro-batches:
   fixed chunks of ``micro_batch_size`` samples, or (dynamic batch size) first-fit bins of at most
   ``max_tokens_per_gpu * cp_size`` tokens, a sample going to the first bin it fits in.
3. The micro-batch count is raised to a multiple of ``dp_size``: dynamically by repeatedly halving the
   bin with the most tokens among those with more than one sample (its samples dealt, longest first, to
   the lighter half); a static count that is not a multiple is an error.
4. Micro-batch ``k`` of the step goes to rank ``k mod dp_size`` (slime's default, ``--balance-data`` off;
   the FLOP-balanced variants only permute which micro-batch lands where).

Returns, per rank, the global sample positions it holds (``partition``) and its micro-batches as local
indices into that list (``micro_batch_indices``), the per-rank micro-batch count of every step
(``num_microbatches``) and the rollouts per step (``global_batch_sizes``).
"""

from __future__ import annotations


def _first_fit(lengths: list[int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, n in enumerate(lengths):
        for b, load in enumerate(loads):
            if load + n <= cap:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


def _halve(members: list[int], lengths: list[int]) -> tuple[list[int], list[int]]:
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in sorted(members, key=lambda j: -lengths[j]):
        h = 0 if loads[0] <= loads[1] else 1
        halves[h].append(i)
        loads[h] += lengths[i]
    return halves


def _grow(bins: list[list[int]], target: int, lengths: list[int]) -> None:
    while len(bins) < target:
        splittable = [(sum(lengths[i] for i in b), k) for k, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            return
        _, k = max(splittable)
        left, right = _halve(bins[k], lengths)
        bins[k] = left
        bins.append(right)


def build_dp_schedule(
    total_lengths: list[int],
    rollout_ids: list[int],
    *,
    global_batch_size: int,
    dp_size: int,
    micro_batch_size: int | None = None,
    max_tokens_per_gpu: int | None = None,
    cp_size: int = 1,
) -> tuple[list[list[int]], list[list[list[int]]], list[int], list[int]]:
    """``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)`` as slime computes them
    (module docstring); dynamic batching when ``max_tokens_per_gpu`` is given, else ``micro_batch_size``."""
    members: dict[int, list[int]] = {}
    for pos, rid in enumerate(rollout_ids):
        members.setdefault(rid, []).append(pos)
    order = list(members)
    n_steps = len(order) // global_batch_size
    assert n_steps >= 1, "fewer rollouts than one step"
    partitions: list[list[int]] = [[] for _ in range(dp_size)]
    mbs_of_rank: list[list[list[int]]] = [[] for _ in range(dp_size)]
    num_mb: list[int] = []
    for s in range(n_steps):
        samples = [p for rid in order[s * global_batch_size:(s + 1) * global_batch_size] for p in members[rid]]
        lengths = [total_lengths[p] for p in samples]
        assert len(samples) >= dp_size, "a step needs a sample per rank"
        if max_tokens_per_gpu is not None:
            bins = _first_fit(lengths, max_tokens_per_gpu * cp_size)
        else:
            bins = [list(range(i, min(i + micro_batch_size, len(samples)))) for i in range(0, len(samples),
                                                                                          micro_batch_size)]
        target = max(-(-len(bins) // dp_size) * dp_size, dp_size)
        if target != len(bins):
            assert max_tokens_per_gpu is not None, "static micro-batch count not a multiple of dp_size"
            _grow(bins, target, lengths)
            assert len(bins) == target, "not enough samples to give every rank a micro-batch"
        num_mb.append(len(bins) // dp_size)
        for r in range(dp_size):
            for k in range(r, len(bins), dp_size):
                start = len(partitions[r])
                partitions[r].extend(samples[i] for i in bins[k])
                mbs_of_rank[r].append(list(range(start, start + len(bins[k]))))
    return partitions, mbs_of_rank, num_mb, [global_batch_size] * n_steps
