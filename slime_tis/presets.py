"""Named presets: dicts of ``TISConfig`` fields (the eight of verl's rollout-correction math doc, plus extras;
differences from verl: docs/reference.md); explicit fields or flags override them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "preset_fields"]

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "decoupled_token_is": ("algorithm 2, token-level truncated IS (upper 2.0)",
                           dict(use_tis=True, mode="truncate", level="token", upper=2.0)),
    "decoupled_seq_is": ("algorithm 2, sequence-level truncated IS (upper 2.0)",
                         dict(use_tis=True, mode="truncate", level="sequence", upper=2.0)),
    "decoupled_seq_is_rs": ("algorithm 2, sequence-level truncated IS + sequence rejection outside [0.5, 2.0]",
                            dict(use_tis=True, mode="truncate", level="sequence", upper=2.0, rs_level="sequence",
                                 rs_lower=0.5, rs_upper=2.0)),
    "decoupled_geo_rs": ("algorithm 2, geometric-mean masking in [0.999, 1.001] + veto 1e-4",
                         dict(use_tis=True, mode="mask", level="geometric", lower=0.999, upper=1.001,
                              veto_threshold=1e-4)),
    "ppo_is_bypass": ("algorithm 1, PPO clipped against the rollout policy; no recompute",
                      dict(use_rollout_log_probs=True)),
    "pg_is": ("algorithm 3, REINFORCE with sequence-level truncated IS (upper 2.0)",
              dict(use_rollout_log_probs=True, use_tis=True, mode="truncate", level="sequence", upper=2.0)),
    "pg_rs": ("algorithm 3, REINFORCE with geometric-mean masking in [0.999, 1.001] + veto 1e-4",
              dict(use_rollout_log_probs=True, use_tis=True, mode="mask", level="geometric", lower=0.999,
                   upper=1.001, veto_threshold=1e-4)),
    "bypass_ppo_clip_k3_rs": (
        "algorithm 1, PPO clipped against the rollout policy + rejection of sequences with mean k3 > 0.01",
        dict(use_rollout_log_probs=True, seq_mean_k3_threshold=0.01)),
    "disabled": ("algorithm 0, no correction; diagnostics only (when rollout log-probs are available)", dict()),
    # extras beyond verl's eight
    "decoupled_token_mask": (
        "algorithm 2, token-level masking outside [0.5, 5.0] (IcePop-style, rejected tokens leave the loss)",
        dict(use_tis=True, mode="mask", level="token", lower=0.5, upper=5.0)),
    "decoupled_token_is_rs": ("algorithm 2, token-level truncated IS + token rejection outside [0.5, 2.0]",
                              dict(use_tis=True, mode="truncate", level="token", upper=2.0, rs_level="token",
                                   rs_lower=0.5, rs_upper=2.0)),
}


def preset_fields(name: str) -> dict[str, Any]:
    """The ``TISConfig`` fields of preset ``name`` (a fresh dict)."""
    if name not in PRESETS:
        raise ValueError(f"--tis-preset = {name!r}: unknown preset; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name][1])
