"""``TISConfig`` from slime's ``args`` namespace (flags + ``--custom-config-path`` YAML keys).

slime has no flags for the plugin's options; they come as YAML keys that slime ``setattr``s onto
``args`` (``--custom-config-path``), named after this package's argparse dests::

    tis_mode, tis_level, tis_upper_bound, tis_lower_bound, tis_rs_level, tis_rs_upper_bound,
    tis_rs_lower_bound, tis_batch_normalize, tis_rejected_denominator, tis_loss_agg, tis_safety_bound,
    tis_preset, and one key per rejection threshold (its flag's dest, e.g. tis_veto_threshold;
    ``slime_tis.config.THRESHOLDS``)

The switches are slime's own flags: ``--use-tis`` (``args.use_tis``) and
``--use-rollout-logprobs`` (``args.use_rollout_logprobs``).

For a drop-in switch from slime's ``examples/train_infer_mismatch_helper/mis.yaml`` the mis.py keys
are translated when the plugin's own keys are absent: ``use_rs`` + ``rs_level`` ->
``tis_rs_level``; ``rs_lower_bound`` / ``rs_upper_bound`` -> rejection bounds (defaulting, as in
mis.py, to the IS bounds); ``rs_veto_threshold`` -> ``tis_veto_threshold`` (only with ``use_rs``,
as mis.py only vetoes inside RS). slime's vanilla-TIS flags ``--tis-clip`` / ``--tis-clip-low`` are
not read.

slime options and slime code the hooks cannot follow are refused here too (:mod:`slime_tis.slime.compat`).
The optional patch's switch ``tis_bypass_skip_recompute`` (:mod:`slime_tis.slime.bypass`) is parsed here too, so
a value it cannot read is refused at the first hook call.

Loss aggregation is slime's: ``--calculate-per-token-loss`` is ``token-mean``, slime's default
per-sample mean is ``seq-mean-token-mean``. A ``tis_loss_agg`` key that contradicts it raises.
"""

from __future__ import annotations

import logging
from typing import Any

from slime_tis.config import DESTS_OF, TISConfig, config_fields_from_args, parse_switch
from slime_tis.core.algorithms import algorithm_of
from slime_tis.slime.agreement import check_slime_settings_agree
from slime_tis.slime.bypass import SKIP_RECOMPUTE_KEY, skip_recompute_requested
from slime_tis.slime.compat import check_slime_compat

__all__ = ["slime_loss_agg", "tis_config_from_slime_args"]

logger = logging.getLogger("slime_tis.slime")

_DESCRIBED: set[TISConfig] = set()

# keys read from args (their values form the cache key): every dest of a TISConfig field, then mis.py's
_KEYS = (
    *(dest for dests in DESTS_OF.values() for dest in dests),
    "tis_preset",
    "use_rs",
    "rs_level",
    "rs_lower_bound",
    "rs_upper_bound",
    "rs_veto_threshold",
    "calculate_per_token_loss",
    SKIP_RECOMPUTE_KEY,
    "use_rollout_logprobs",
    # read by the start-up checks (slime_tis.slime.compat)
    "rs_batch_refill",
    "rollout_top_k",
    "rollout_top_p",
    "use_opsm",
)
_CACHE: dict[tuple, TISConfig] = {}


def slime_loss_agg(args: Any) -> str:
    """The aggregation slime applies: ``token-mean`` with ``--calculate-per-token-loss``, else
    ``seq-mean-token-mean`` (slime's per-sample mean)."""
    return "token-mean" if getattr(args, "calculate_per_token_loss", False) else "seq-mean-token-mean"


def _mis_translation(args: Any, fields: dict[str, Any]) -> None:
    use_rs = getattr(args, "use_rs", None)  # a YAML key: strictly parsed ("false" is off)
    if use_rs is None or not parse_switch("use_rs", use_rs) or fields.get("rs_level") is not None:
        return
    rs_level = getattr(args, "rs_level", None)
    if rs_level is None:
        return
    fields["rs_level"] = rs_level
    lower = getattr(args, "rs_lower_bound", None)
    upper = getattr(args, "rs_upper_bound", None)
    # mis.py: rejection bounds default to the IS bounds
    fields["rs_upper"] = upper if upper is not None else fields.get("upper")
    fields["rs_lower"] = lower if lower is not None else fields.get("lower")
    veto = getattr(args, "rs_veto_threshold", None)
    if veto is not None and fields.get("veto_threshold") is None:
        fields["veto_threshold"] = veto


def tis_config_from_slime_args(args: Any, *, algorithm: int | None = None) -> TISConfig:
    """Build (and cache) the validated ``TISConfig`` of a slime run.

    Args:
        args: slime's namespace.
        algorithm: force the algorithm (the REINFORCE + IS loss passes 3, since slime's flags cannot
            combine ``--use-rollout-logprobs`` and ``--use-tis``); ``None`` derives it from the flags.

    Raises:
        ValueError: invalid options (naming the flag/key and value), a ``tis_loss_agg`` key that
            contradicts slime's aggregation, or settings that differ across the ranks of the pipeline stage
            (compared when a configuration is first built, :mod:`slime_tis.slime.agreement`).
    """
    key = (algorithm, *(repr(getattr(args, k, None)) for k in _KEYS))
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    fields = config_fields_from_args(args)
    skip_recompute_requested(args)  # the optional patch's switch: a value it would misread is refused here
    _mis_translation(args, fields)
    agg = slime_loss_agg(args)
    given = fields.get("loss_agg")
    if given is not None and given != agg:
        raise ValueError(
            f"tis_loss_agg = {given!r} contradicts slime's aggregation {agg!r} "
            f"(--calculate-per-token-loss = {bool(getattr(args, 'calculate_per_token_loss', False))}); "
            "in slime the aggregation is chosen by --calculate-per-token-loss"
        )
    fields["loss_agg"] = agg
    if algorithm is not None:
        if algorithm not in (0, 1, 2, 3):
            raise ValueError(f"algorithm must be 0, 1, 2 or 3, got {algorithm!r}")
        fields["use_rollout_log_probs"] = bool(algorithm & 1)
        fields["use_tis"] = bool(algorithm & 2)
    cfg = TISConfig(**fields)
    check_slime_compat(args, slime_policy_loss=algorithm_of(cfg).ppo)
    check_slime_settings_agree(args, cfg)  # once per configuration, on every rank of the pipeline stage
    if cfg not in _DESCRIBED:
        _DESCRIBED.add(cfg)
        logger.info("%s", cfg.describe())
        cfg.warn_inert()
    _CACHE[key] = cfg
    return cfg
