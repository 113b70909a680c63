"""Guard against the top-p / top-k / min-p bias of SGLang's rollout log-probs.

SGLang's ``output_token_logprobs`` are log-probs of the full temperature-scaled distribution, while the tokens were
drawn from the truncated one, ``q(y) = p(y) / S`` on the kept support: every token log-ratio is off by ``log S``.
:func:`check_sampling_params` warns (once per setting, ``warnings`` and the logger) when the parameters truncate and
the request is neither slime's replay of the support nor declared renormalised (docs/sglang.md, "Top-p / top-k").
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ENV_RENORMALIZED", "REPLAY_PARAM", "TOP_K_ALL", "SamplingCheck", "TruncatedSamplingWarning",
           "check_sampling_params"]

logger = logging.getLogger("slime_tis.sglang")

ENV_RENORMALIZED = "SLIME_TIS_RENORMALIZED_LOGPROBS"
#: the ``custom_params`` entry with which slime's rollout asks for the kept token ids it replays in training
REPLAY_PARAM = "return_top_p_token_ids"
#: SGLang's "whole vocabulary" top-k (``sampling_params.py``: ``TOP_K_ALL = 1 << 30``), the value
#: ``-1`` is turned into and the default its request schema shows.
TOP_K_ALL = 1 << 30
#: SGLang's sampling parameters: (default, type, whether SGLang accepts a value, what it accepts)
_PARAMS = {
    "temperature": (1.0, float, lambda v: v >= 0.0, ">= 0"),
    "top_p": (1.0, float, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (-1, int, lambda v: v == -1 or v >= 1, "-1 (disabled) or >= 1"),
    "min_p": (0.0, float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
}
_WARNED: set[tuple[float, int, float]] = set()  # the settings warned about


class TruncatedSamplingWarning(UserWarning):
    """SGLang rollout log-probs ignore top-p/top-k/min-p: importance ratios are biased."""


@dataclass(frozen=True)
class SamplingCheck:
    """``truncated``: top-p < 1, 0 < top-k < 2**30 or min-p > 0; ``replayed``: top-p < 1 with slime's
    ``custom_params[REPLAY_PARAM]``; ``biased``: truncated, neither replayed nor declared renormalised; ``warned``:
    this call warned."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    truncated: bool
    biased: bool
    warned: bool
    replayed: bool = False


def check_sampling_params(sampling_params: Mapping[str, Any] | None, *,
                          renormalized_logprobs: bool | None = None) -> SamplingCheck:
    """Check SGLang ``sampling_params`` (SGLang's defaults where absent) and warn, once per setting, when the
    log-probs will be biased. ``renormalized_logprobs``: the engine returns log-probs renormalised over the kept
    support and the trainer masks alike (``None``: read :data:`ENV_RENORMALIZED`). Values SGLang refuses
    (``top_p`` outside (0, 1], ``top_k`` 0 or < -1, ``min_p`` outside [0, 1], ``temperature`` < 0) raise."""
    params = dict(sampling_params or {})
    values = {}
    for key, (default, kind, accepted, what) in _PARAMS.items():
        value = default if params.get(key) is None else params[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"sampling_params[{key!r}] must be a number, got {value!r}")
        values[key] = kind(value)
        if not accepted(values[key]):
            raise ValueError(f"sampling_params[{key!r}] must be {what}, got {values[key]}")
    top_p, top_k, min_p = values["top_p"], values["top_k"], values["min_p"]
    top_k_on = 0 < top_k < TOP_K_ALL
    truncated = top_p < 1.0 or top_k_on or min_p > 0.0
    if renormalized_logprobs is None:
        renormalized_logprobs = os.environ.get(ENV_RENORMALIZED, "").strip().lower() in ("1", "true", "yes", "on")
    custom = params.get("custom_params")  # slime's replay of the kept ids (only with --rollout-top-p < 1)
    replayed = top_p < 1.0 and isinstance(custom, Mapping) and custom.get(REPLAY_PARAM) is True
    biased = truncated and not renormalized_logprobs and not replayed
    warned = biased and (top_p, top_k, min_p) not in _WARNED
    if warned:
        _WARNED.add((top_p, top_k, min_p))
        flags = ((f"top_p={top_p}", top_p < 1), (f"top_k={top_k}", top_k_on), (f"min_p={min_p}", min_p > 0))
        active = ", ".join(s for s, on in flags if on)
        msg = (
            f"SGLang sampling uses {active}, but SGLang's output_token_logprobs are log-probs of the "
            "full temperature-scaled distribution (truncation ignored). The sampled tokens come from the "
            "truncated distribution, so every importance ratio pi_train/pi_rollout is biased by the kept "
            "mass S_t (log-ratio off by log S_t per token; sequence ratios by the product). Either sample "
            "with top_p=1, top_k=-1, min_p=0 for TIS/MIS training; or let SGLang (>= 0.5.23) return the "
            "truncated distribution's log-probs: send \"return_sampling_mask\": true "
            "(generate_request(..., sampling_logprobs=True)) and parse with rollout_logprobs=\"sampling\", "
            "which uses meta_info.output_token_sampling_logprobs as pi_rollout; or, in slime, sample with "
            "--rollout-top-p < 1 so that slime replays the truncated support (its request carries "
            f"custom_params {{\"{REPLAY_PARAM}\": true}}; slime does not replay top-k or min-p alone); or, "
            "with another engine that returns renormalised log-probs while the trainer masks its logits to the "
            f"same support, declare it with renormalized_logprobs=True or {ENV_RENORMALIZED}=1.")
        logger.warning(msg)
        warnings.warn(msg, TruncatedSamplingWarning, stacklevel=2)
    return SamplingCheck(**values, truncated=truncated, biased=biased, warned=warned, replayed=replayed)

