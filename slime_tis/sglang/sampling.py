"""Guard against the top-p / top-k / min-p bias of SGLang's rollout log-probs.

SGLang returns, for every generated token, ``log softmax(logits / T)[token]`` of the **full**
temperature-scaled distribution; top-p, top-k and min-p truncation is ignored when the log-prob is
computed. The token, however, was drawn from the truncated, renormalised distribution
``q_t(y) = p_t(y) / S_t`` on the kept support, where ``S_t`` is the kept probability mass. The
true behaviour log-prob is therefore ``log p_t(y) - log S_t``, and every per-token log-ratio
``lp_train - lp_rollout`` computed from SGLang's numbers is off by ``+log S_t <= 0`` relative to
the correct one (e.g. ``S = 0.9`` at ``top_p = 0.9``: each token's ratio is biased by 0.9, a
100-token sequence ratio by ``0.9**100``).

The ways out:

* **slime's replay of the truncated support** (slime with ``--rollout-top-p < 1``): slime's rollout asks
  SGLang for the kept token ids (``sampling_params["custom_params"] = {"return_top_p_token_ids": True}``);
  SGLang built with slime's patch (slime's image) then returns log-probs renormalised over the kept support
  (top-p together with top-k / min-p, plus the sampled token) and the kept ids, and slime's trainer masks
  its logits to the same ids before the log-softmax. Both log-probs are then of the same truncated policy
  and the ratio is unbiased; slime stops if the engine did not return the ids. A request with
  ``top_p < 1`` that carries this custom parameter is recognised here as replayed (nothing to declare).
  slime replays only when ``--rollout-top-p < 1``: top-k or min-p alone are not replayed.
* SGLang >= 0.5.23 can return the truncated distribution's log-probs itself: request with
  ``"return_sampling_mask": true`` and parse with ``rollout_logprobs="sampling"``
  (``meta_info.output_token_sampling_logprobs`` becomes pi_rollout; the ratio is then the true
  importance ratio of the trainer's full-vocabulary policy to the truncated behaviour distribution,
  ``S_t`` times the untruncated one).
* Another engine that returns renormalised log-probs while the trainer masks its logits to the same
  support: declare it with ``renormalized_logprobs=True`` or the environment variable
  ``SLIME_TIS_RENORMALIZED_LOGPROBS=1``.
* Otherwise train with ``top_p = 1``, ``top_k = -1``, ``min_p = 0``. ``top_k = -1`` and
  ``top_k >= 2**30`` (SGLang's ``TOP_K_ALL``, the schema default of ``top_k``) both mean "no top-k".

This module warns once per process and setting, loudly (``warnings.warn`` and the logger), when
the sampling parameters truncate and the request is neither replayed nor declared renormalised.
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
    "REPLAY_PARAM",
    "TOP_K_ALL",
    "SamplingCheck",
    "TruncatedSamplingWarning",
    "check_sampling_params",
    "reset_sampling_warnings",
]

logger = logging.getLogger("slime_tis.sglang")

ENV_RENORMALIZED = "SLIME_TIS_RENORMALIZED_LOGPROBS"
#: the ``custom_params`` entry with which slime's rollout asks for the kept token ids it replays in training
REPLAY_PARAM = "return_top_p_token_ids"
#: SGLang's "whole vocabulary" top-k (``sampling_params.py``: ``TOP_K_ALL = 1 << 30``), the value
#: ``-1`` is turned into and the default its request schema shows.
TOP_K_ALL = 1 << 30
_WARNED: set[tuple[float, int, float]] = set()


class TruncatedSamplingWarning(UserWarning):
    """SGLang rollout log-probs ignore top-p/top-k/min-p: importance ratios are biased."""


@dataclass(frozen=True)
class SamplingCheck:
    """Result of :func:`check_sampling_params`.

    ``truncated`` is true when top-p < 1, 0 < top-k < 2**30 or min-p > 0; ``replayed`` when the request asks
    for slime's replay of the truncated support (top-p < 1 and ``custom_params["return_top_p_token_ids"]``);
    ``biased`` when it is truncated, not replayed and renormalised log-probs were not declared; ``warned`` when
    this call emitted the warning.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    truncated: bool
    biased: bool
    warned: bool
    replayed: bool = False


def _env_declares_renormalized() -> bool:
    return os.environ.get(ENV_RENORMALIZED, "").strip().lower() in ("1", "true", "yes", "on")


def _replayed(params: Mapping[str, Any], top_p: float) -> bool:
    """slime's rollout asks for the kept token ids (``custom_params``) and replays them in training; slime's
    trainer masks its logits only when ``--rollout-top-p < 1``."""
    custom = params.get("custom_params")
    return top_p < 1.0 and isinstance(custom, Mapping) and custom.get(REPLAY_PARAM) is True


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
            -1 and >= ``TOP_K_ALL`` = 2**30 mean no top-k; ``custom_params`` with
            ``return_top_p_token_ids: True`` and ``top_p < 1``: slime's replay, module docstring).
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
    replayed = _replayed(params, top_p)
    biased = truncated and not declared and not replayed
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
            "which uses meta_info.output_token_sampling_logprobs as pi_rollout; or, in slime, sample with "
            "--rollout-top-p < 1 so that slime replays the truncated support (its request carries "
            f"custom_params {{\"{REPLAY_PARAM}\": true}}; slime does not replay top-k or min-p alone); or, "
            "with another engine that returns renormalised log-probs while the trainer masks its logits to the "
            f"same support, declare it with renormalized_logprobs=True or {ENV_RENORMALIZED}=1."
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
        replayed=replayed,
    )


def reset_sampling_warnings() -> None:
    """Forget which settings were warned about (tests; a new run in the same process)."""
    _WARNED.clear()
