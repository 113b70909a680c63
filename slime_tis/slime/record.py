"""Recording the training log-probs of the algorithm-3 custom loss (YAML key ``tis_record_train_log_probs``).

With algorithm 3 slime runs no pi_old recompute (``--use-rollout-logprobs``), so neither slime's
``--save-debug-train-data`` dump nor this package's dump has training log-probs. With
``tis_record_train_log_probs: true`` :func:`slime_tis.slime.reinforce_is_loss` keeps, for every sample,
the detached CP-local ``log pi_theta`` its loss used: the parameters of the optimizer step that trains
on the sample (each sample belongs to one step of its rollout; a replay under
``--recompute-loss-function`` is ignored: first occurrence wins, as in slime's own capture). In the loss
there is no host synchronisation: only ``detach().clone()`` of device tensors and Python bookkeeping.
The values go to

* slime's own capture (``_maybe_capture_log_probs`` of ``slime/backends/megatron_utils/loss.py`` at
  THUDM/slime 624b824, active when ``--save-debug-train-data`` is set and slime skipped the recompute):
  slime's train dump then carries per-sample ``log_probs``. This also happens without the option
  whenever ``--save-debug-train-data`` is set, as with slime's own policy loss;
* this package's dump (needs the rollout-data hook), written outside the loss: when ``tis_dump_dir``
  is set, the rollout-data hook of the next rollout (or :func:`flush_recorded_train_log_probs` after
  the last one) gathers the CP chunks and appends the previous rollout's samples to
  ``<tis_dump_dir>/logprobs_theta_dp<rank>.jsonl`` (header ``train_policy: "theta_first_forward"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slime_tis.config import parse_switch
from slime_tis.slime.batch import gather_full_responses, pack_slime_batch
from slime_tis.tools.dump import records_from_samples, write_logprob_dump

__all__ = ["RECORDER", "TrainLogProbRecorder", "flush_recorded_train_log_probs", "recording_enabled"]


def recording_enabled(args: Any) -> bool:
    """The ``tis_record_train_log_probs`` YAML key, strictly parsed (a quoted ``"false"`` is off)."""
    value = getattr(args, "tis_record_train_log_probs", None)
    return value is not None and parse_switch("tis_record_train_log_probs", value)


def _slime_capture() -> Any:
    """slime's capture function, or None outside slime (or in a slime without it)."""
    try:
        from slime.backends.megatron_utils import loss as slime_loss
    except Exception:  # noqa: BLE001 - slime absent or not importable here: nothing to forward to
        return None
    return getattr(slime_loss, "_maybe_capture_log_probs", None)


class TrainLogProbRecorder:
    """First-seen detached CP-local training log-probs per sample of the current rollout."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._values: dict[int, tuple[Tensor, Tensor]] = {}  # id(loss mask) -> (mask, log-probs)
        self._rollout: dict[str, Any] | None = None

    def start_rollout(self, rollout_id: Any, rollout_data: dict[str, Any]) -> None:
        """Forget the previous rollout; keep references to what the dump of this one needs."""
        self.clear()
        self._rollout = {
            "rollout_id": rollout_id,
            **{k: rollout_data.get(k) for k in
               ("loss_masks", "rollout_log_probs", "total_lengths", "response_lengths")},
        }

    def record(self, batch: dict[str, Any], per_sample: Sequence[Tensor]) -> None:
        """Keep ``per_sample[i]`` (CP-local ``[T_i]``) for ``batch['loss_masks'][i]`` unless already kept."""
        capture = _slime_capture()
        if capture is not None:
            capture(batch, list(per_sample))
        if self._rollout is None:  # no rollout-data hook: nothing would ever write (or free) our copies
            return
        for mask, lp in zip(batch["loss_masks"], per_sample):
            if id(mask) not in self._values:
                self._values[id(mask)] = (mask, lp.detach().clone())

    def recorded(self, mask: Tensor) -> Tensor | None:
        entry = self._values.get(id(mask))
        return entry[1] if entry is not None and entry[0] is mask else None

    @property
    def rollout(self) -> dict[str, Any] | None:
        return self._rollout


RECORDER = TrainLogProbRecorder()


def flush_recorded_train_log_probs(args: Any, *, meta: dict[str, Any] | None = None) -> int:
    """Append the recorded samples of the current rollout to ``<tis_dump_dir>/logprobs_theta_dp<rank>.jsonl``.

    Runs on every rank of the CP group (one CP all-reduce per quantity; no-op without ``tis_dump_dir``,
    without recording, or when nothing of the rollout was registered). Returns the number of records
    written on this rank. Samples the loss never saw (other pipeline stages) are not written.
    """
    from slime_tis.engine.parallel import parallel_context

    dump_dir = getattr(args, "tis_dump_dir", None)
    data = RECORDER.rollout
    if not dump_dir or not recording_enabled(args) or data is None or not data.get("loss_masks"):
        return 0
    if data.get("rollout_log_probs") is None:
        raise ValueError("tis_record_train_log_probs: the dump needs rollout_data['rollout_log_probs']")
    ctx = parallel_context()
    masks = list(data["loss_masks"])
    packed = pack_slime_batch(masks, data["total_lengths"], data["response_lengths"], ctx.cp_rank, ctx.cp_size)
    got = [RECORDER.recorded(m) for m in masks]
    device = packed.full_mask.device
    local = [g if g is not None else torch.zeros(int(n), device=device)
             for g, n in zip(got, packed.local_lengths.tolist())]  # host-sync-ok (CPU lengths; outside the loss)
    train_full = gather_full_responses(packed, packed.cat_local("recorded log-probs", local).to(device), ctx.reducer)
    rollout_local = packed.cat_local("rollout_log_probs", data["rollout_log_probs"]).to(device)
    rollout_full = gather_full_responses(packed, rollout_local, ctx.reducer)
    keep = [i for i, g in enumerate(got) if g is not None]
    RECORDER.clear()
    if not keep or ctx.cp_rank != 0 or ctx.tp_rank != 0:
        return 0
    rid = data["rollout_id"]
    recs = records_from_samples([train_full[i] for i in keep], [rollout_full[i] for i in keep],
                                [masks[i] for i in keep], step=rid if isinstance(rid, int) else None,
                                sample_index=keep)
    header = {"train_policy": "theta_first_forward", "algorithm": 3, "writer": "slime_tis.slime", **(meta or {})}
    return write_logprob_dump(Path(dump_dir) / f"logprobs_theta_dp{ctx.dp_rank}.jsonl", recs, append=True,
                              meta=header)
