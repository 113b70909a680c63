"""Guard against the top-p / top-k / min-p bias of SGLang's rollout log-probs.

SGLang returns, for every generated token, ``log softmax(logits / T)[token]`` of the **full**
temperature-scaled distribution; top-p, top-k and min-p truncation is ignored when the log-prob is
computed. The token, however, was drawn from the truncated, renormalised distribution
``q_t(y) = p_t(y) / S_t`` on the kept support, where ``S_t`` is the kept probability mass. The
true behaviour log-prob is therefore ``log p_t(y) - log S_t``, and every per-token log-ratio
``lp_train - lp_rollout`` computed from SGLang's numbers is off by ``+log S_t <= 0`` relative to
the correct one (e.g. ``S = 0.9`` at ``top_p = 0.9``: each token's ratio is biased by 0.9, a
100-token sequence ratio by ``0.9**100``).

SGLang >= 0.5.23 can return the truncated distribution's log-probs itself: request with
``"return_sampling_mask": true`` and parse with ``rollout_logprobs="sampling"``
(``meta_info.output_token_sampling_logprobs`` becomes pi_rollout; the ratio is then the true
importance ratio of the trainer's full-vocabulary policy to the truncated behaviour distribution,
``S_t`` times the untruncated one). Otherwise, unless the engine returns renormalised log-probs
*and* the trainer masks its logits to the same support (slime's top-p replay), train with
``top_p = 1``, ``top_k = -1``, ``min_p = 0``. ``top_k = -1`` and ``top_k >= 2**30`` (SGLang's
``TOP_K_ALL``, the schema default of ``top_k``) both mean "no top-k".

This module warns once per process and setting, loudly (``warnings.warn`` and the logger), when
the sampling parameters truncate and the user did not declare renormalised log-probs
(``renormalized_logprobs=True`` or the environment variable ``SLIME_TIS_RENORMALIZED_LOGPROBS=1``).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENV_RENORMALIZED",
    "TOP_K_ALL",
    "SamplingCheck",
    "TruncatedSamplingWarning",
    "check_sampling_params",
    "reset_sampling_warnings",
]

logger = logging.getLogger("slime_tis.sglang")

ENV_RENORMALIZED = "SLIME_TIS_RENORMALIZED_LOGPROBS"
#: SGLang's "whole vocabulary" top-k (``sampling_params.py``: ``TOP_K_ALL = 1 << 30``), the value
#: ``-1`` is turned into and the default its request schema shows.
TOP_K_ALL = 1 << 30
_WARNED: set[tuple[float, int, float]] = set()


class TruncatedSamplingWarning(UserWarning):
    """SGLang rollout log-probs ignore top-p/top-k/min-p: importance ratios are biased."""


@dataclass(frozen=True)
class SamplingCheck:
    """Result of :func:`check_sampling_params`.

    ``truncated`` is true when top-p < 1, 0 < top-k < 2**30 or min-p > 0; ``biased`` when it is truncated
    and renormalised log-probs were not declared; ``warned`` when this call emitted the warning.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    truncated: bool
    biased: bool
    warned: bool


def _env_declares_renormalized() -> bool:
    return os.environ.get(ENV_RENORMALIZED, "").strip().lower() in ("1", "true", "yes", "on")


def _number(params: Mapping[str, Any], key: str, default: float, kind: type) -> Any:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"sampling_params[{key!r}] must be a number, got {value!r}")
    return kind(value)


def check_sampling_params(
    sampling_params: Mapping[str, Any] | None,
    *,
    renormalized_logprobs: bool | None = None,
) -> SamplingCheck:
    """Inspect SGLang ``sampling_params`` and warn (once per setting) if the log-probs will be biased.

    Args:
        sampling_params: the request's ``sampling_params`` dict (SGLang keys ``temperature``,
            ``top_p``, ``top_k``, ``min_p``; SGLang defaults 1.0, 1.0, -1, 0.0 when absent; ``top_k``
            -1 and >= ``TOP_K_ALL`` = 2**30 mean no top-k).
        renormalized_logprobs: the user declares that the engine returns log-probs renormalised
            over the truncated support (and that training masks its logits the same way). ``None``
            reads ``SLIME_TIS_RENORMALIZED_LOGPROBS``.

    Raises:
        ValueError / TypeError: for values SGLang itself would reject (``top_p`` outside (0, 1],
            ``top_k`` = 0 or < -1, ``min_p`` outside [0, 1], negative ``temperature``), naming the
            key and the value.
    """
    params = dict(sampling_params or {})
    temperature = _number(params, "temperature", 1.0, float)
    top_p = _number(params, "top_p", 1.0, float)
    top_k = _number(params, "top_k", -1, int)
    min_p = _number(params, "min_p", 0.0, float)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"sampling_params['top_p'] must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"sampling_params['top_k'] must be -1 (disabled) or >= 1, got {top_k}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"sampling_params['min_p'] must be in [0, 1], got {min_p}")
    if temperature < 0.0:
        raise ValueError(f"sampling_params['temperature'] must be >= 0, got {temperature}")

    top_k_on = 0 < top_k < TOP_K_ALL
    truncated = top_p < 1.0 or top_k_on or min_p > 0.0
    declared = _env_declares_renormalized() if renormalized_logprobs is None else bool(renormalized_logprobs)
    biased = truncated and not declared
    warned = False
    key = (top_p, top_k, min_p)
    if biased and key not in _WARNED:
        _WARNED.add(key)
        warned = True
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
            "which uses meta_info.output_token_sampling_logprobs as pi_rollout; or make the engine return "
            "renormalised log-probs and mask the trainer's logits to the same support (slime's top-p replay), "
            f"then declare it with renormalized_logprobs=True or {ENV_RENORMALIZED}=1."
        )
        logger.warning(msg)
        warnings.warn(msg, TruncatedSamplingWarning, stacklevel=2)
    return SamplingCheck(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        truncated=truncated,
        biased=biased,
        warned=warned,
    )


def reset_sampling_warnings() -> None:
    """Forget which settings were warned about (tests; a new run in the same process)."""
    _WARNED.clear()
