"""slime's arguments read once (:func:`slime_view`): the ``TISConfig`` and the slime flags the hooks read.

Options are ``--custom-config-path`` YAML keys named after this package's argparse dests (``tis_mode``, ...);
slime's ``mis.yaml`` keys are translated when the plugin's are absent; the aggregation is slime's
(``--calculate-per-token-loss``). Building a view runs the start-up refusals (:mod:`slime_tis.slime.compat`) and
compares the settings across the ranks of the pipeline stage (docs/slime.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from slime_tis.config import DESTS_OF, TISConfig, config_fields_from_args, parse_switch
from slime_tis.core.algorithms import algorithm_of
from slime_tis.engine.settings import CHUNK_SIZE
from slime_tis.slime.bypass import SKIP_RECOMPUTE_KEY, skips_pi_old_recompute
from slime_tis.slime.compat import check_slime_compat
from slime_tis.slime.state import STATE

__all__ = ["SlimeView", "check_slime_settings_agree", "slime_view", "tis_config_from_slime_args"]

logger = logging.getLogger("slime_tis.slime")

TIS_FUNCTION = "slime_tis.slime.compute_tis_for_slime"

#: slime flags the hooks read, with slime's defaults (a missing attribute reads as its default)
_SLIME = {
    "use_rollout_logprobs": False, "use_opsm": False, "calculate_per_token_loss": False,
    "custom_pg_loss_reducer_function_path": None, "tis_dump_dir": None, "tis_metrics_path": None,
    "tis_record_train_log_probs": None, SKIP_RECOMPUTE_KEY: None, "rollout_temperature": None,
    "log_probs_chunk_size": None, "entropy_coef": None, "use_kl_loss": False, "kl_loss_coef": None,
    "kl_loss_type": "k1", "use_unbiased_kl": False, "rollout_top_p": 1.0, "rollout_top_k": -1,
    "allgather_cp": False, "save_debug_train_data": None, "advantage_estimator": None, "loss_type": "policy_loss",
    "custom_loss_function_path": None, "custom_tis_function_path": None, "rs_batch_refill": False,
}
_MIS = ("use_rs", "rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")
_KEYS = (*(d for dests in DESTS_OF.values() for d in dests), "tis_preset", *_MIS, *_SLIME)


@dataclass(frozen=True)
class SlimeView:
    """The configuration and slime's value of every :data:`_SLIME` flag (``view.use_opsm``)."""

    cfg: TISConfig
    flags: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        flags = self.__dict__.get("flags")
        if flags is not None and name in flags:
            return flags[name]
        raise AttributeError(name)

    @property
    def temperature(self) -> float:
        return float(self.rollout_temperature or 1.0)

    @property
    def chunk_size(self) -> int:
        """Rows per log-softmax chunk (slime's ``-1``: no chunking, returned as ``0``)."""
        chunk = int(self.log_probs_chunk_size or CHUNK_SIZE)
        return chunk if chunk > 0 else 0

    @property
    def entropy(self) -> float:
        return float(self.entropy_coef or 0.0)

    @property
    def kl(self) -> float:
        return float(self.kl_loss_coef or 0.0) if self.use_kl_loss else 0.0

    @property
    def host_kl(self) -> bool:
        """The custom loss adds slime's KL term to the loss: its corrections check ``ref_log_probs``."""
        return self.kl != 0.0 and not algorithm_of(self.cfg).ppo

    @property
    def recording(self) -> bool:
        """The ``tis_record_train_log_probs`` key (strictly parsed: a quoted ``"false"`` is off)."""
        value = self.tis_record_train_log_probs
        return value is not None and parse_switch("tis_record_train_log_probs", value)

    @property
    def skips_recompute(self) -> bool:
        """The patched slime skips its pi_old pass (:func:`slime_tis.slime.bypass.skips_pi_old_recompute`)."""
        return skips_pi_old_recompute(self)


def slime_view(args: Any, *, algorithm: int | str | None = "loss") -> SlimeView:
    """The :class:`SlimeView` of slime's ``args``, built once per distinct set of values. ``algorithm``: ``"loss"``
    3 where slime's loss is the custom loss ``reinforce_is_loss``, else from slime's flags; ``None`` from slime's
    flags; or forced. Raises ``ValueError`` naming the option for what is refused."""
    key = (algorithm, *(repr(getattr(args, k, None)) for k in _KEYS))
    view = STATE.views.get(key)
    if view is not None:
        return view
    flags = {k: getattr(args, k, default) for k, default in _SLIME.items()}
    if algorithm == "loss":
        custom = flags["loss_type"] == "custom_loss" and str(flags["custom_loss_function_path"] or "").endswith(
            "reinforce_is_loss")
        return slime_view(args, algorithm=3 if custom else None)
    fields = config_fields_from_args(args)
    mis = {k: getattr(args, k, None) for k in _MIS}  # slime's mis.yaml keys, used when the plugin's are absent
    use_rs = mis["use_rs"] is not None and parse_switch("use_rs", mis["use_rs"])  # strictly: "false" is off
    if use_rs and fields.get("rs_level") is None and mis["rs_level"] is not None:
        fields["rs_level"] = mis["rs_level"]
        for ours, theirs, bound in (("rs_upper", "rs_upper_bound", "upper"), ("rs_lower", "rs_lower_bound", "lower")):
            fields[ours] = mis[theirs] if mis[theirs] is not None else fields.get(bound)  # mis.py: the IS bounds
        if mis["rs_veto_threshold"] is not None and fields.get("veto_threshold") is None:
            fields["veto_threshold"] = mis["rs_veto_threshold"]
    agg = "token-mean" if flags["calculate_per_token_loss"] else "seq-mean-token-mean"
    given = fields.get("loss_agg")
    if given is not None and given != agg:
        raise ValueError(f"tis_loss_agg = {given!r} contradicts slime's aggregation {agg!r} (--calculate-per-token-loss"
                         f" = {bool(flags['calculate_per_token_loss'])}); in slime the aggregation is chosen by "
                         "--calculate-per-token-loss")
    fields["loss_agg"] = agg
    if algorithm is not None:
        if algorithm not in (0, 1, 2, 3):
            raise ValueError(f"algorithm must be 0, 1, 2 or 3, got {algorithm!r}")
        fields["use_rollout_log_probs"], fields["use_tis"] = bool(algorithm & 1), bool(algorithm & 2)
    view = SlimeView(TISConfig(**fields), MappingProxyType(flags))
    view.recording  # noqa: B018 - strictly parsed now: a value it would misread is refused at the first hook call
    check_slime_compat(view)
    check_slime_settings_agree(view)  # once per configuration, on every rank of the pipeline stage
    if view.cfg not in STATE.described:
        STATE.described.add(view.cfg)
        logger.info("%s", view.cfg.describe())
        view.cfg.warn_inert()
    STATE.views[key] = view
    return view


def tis_config_from_slime_args(args: Any, *, algorithm: int | str | None = None) -> TISConfig:
    """The validated ``TISConfig`` of slime's ``args`` (:func:`slime_view`'s; by default from slime's flags)."""
    return slime_view(args, algorithm=algorithm).cfg


def check_slime_settings_agree(view: SlimeView) -> None:
    """A ``ValueError`` on every rank where the resolved configuration or a flag the hooks' collectives and numbers
    depend on differs across this rank's pipeline stage (TP x DP x CP); a no-op without megatron's parallel_state."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # megatron-core is optional for single-process use
        return
    if not ps.model_parallel_is_initialized():
        return
    from slime_tis.engine.agreement import check_settings_agree, config_settings

    settings = {**config_settings(view.cfg), "tis_dump_dir (given)": bool(view.tis_dump_dir),
                "tis_record_train_log_probs": view.recording, "--rollout-temperature": view.rollout_temperature,
                "--log-probs-chunk-size": view.log_probs_chunk_size, "--entropy-coef": view.entropy_coef}
    check_settings_agree(settings, what="slime_tis (slime hooks)",
                         group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
