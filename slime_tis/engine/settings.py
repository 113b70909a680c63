"""``LogProbSettings``: how a host turns the model's output into token log-probs (``temperature``, ``chunk_size``,
``output_layer``: ``None`` / ``"fp32"`` / ``"fused"``, ``kernels``, ``sampling_support``: ``"full"`` / ``"replay"`` /
``None`` = replay where the micro-batch carries a support), built once at the host's boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_tis.kernels.dispatch import DEFAULT_KERNELS, check_args
from slime_tis.kernels.logprobs_torch import CHUNK_SIZE

__all__ = ["CHUNK_SIZE", "LogProbSettings", "OUTPUT_LAYER_MODES", "SAMPLING_SUPPORT_MODES", "output_layer_of"]

#: The model's output-layer modes: ``None`` (as built), ``"fp32"``, ``"fused"``.
OUTPUT_LAYER_MODES = (None, "fused", "fp32")
#: ``--tis-sampling-support``: the trainer's log-probs over the full vocabulary or over the sampled support.
SAMPLING_SUPPORT_MODES = ("full", "replay")


def output_layer_of(fused_output_layer: bool = False, fp32_lm_head: bool = False) -> str | None:
    """The two host options (``--tis-fused-output-layer``, ``--tis-fp32-lm-head``) -> ``"fused"``, ``"fp32"``
    or ``None``; both set is an error (the fused layer already computes the LM head in float32)."""
    for name, value in (("fused_output_layer", fused_output_layer), ("fp32_lm_head", fp32_lm_head)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    if fused_output_layer and fp32_lm_head:
        raise ValueError("--tis-fused-output-layer and --tis-fp32-lm-head (fused_output_layer=True, "
                         "fp32_lm_head=True) are mutually exclusive: the fused output layer already computes "
                         "the LM head with float32 accumulation; set one of them")
    return "fused" if fused_output_layer else "fp32" if fp32_lm_head else None


@dataclass(frozen=True)
class LogProbSettings:
    """The log-prob settings of every pass of a step (module docstring)."""

    temperature: float = 1.0
    chunk_size: int = CHUNK_SIZE
    output_layer: str | None = None
    kernels: str = DEFAULT_KERNELS
    sampling_support: str | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"temperature must be a number > 0 (the rollout sampling temperature), got {t!r}")
        check_args(t, self.chunk_size)
        if self.output_layer not in OUTPUT_LAYER_MODES:
            raise ValueError(f"output layer mode must be one of {OUTPUT_LAYER_MODES}, got {self.output_layer!r}")
        if self.sampling_support is not None and self.sampling_support not in SAMPLING_SUPPORT_MODES:
            raise ValueError(f"sampling_support must be one of {SAMPLING_SUPPORT_MODES} or None, "
                             f"got {self.sampling_support!r}")
        object.__setattr__(self, "temperature", float(t))
