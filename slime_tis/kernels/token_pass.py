"""``token_pass_for``: the correction core's token pass for a ``kernels`` choice (``--tis-kernels``), resolved once
by ``TISConfig``: ``None`` (the core's torch code) for ``"torch"``, :func:`triton_token_pass` for ``"triton"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from slime_tis.kernels import dispatch

if TYPE_CHECKING:
    from slime_tis.core.ratios import TokenPass

__all__ = ["token_pass_for", "triton_token_pass"]


def triton_token_pass(lp_train: Tensor, lp_rollout: Tensor, valid: Tensor, offsets: Tensor,
                      extra_finite: tuple[Tensor, ...]) -> tuple[Tensor, Tensor] | None:
    """``(l [T] float32, sums [n_seq, 3] float64)`` from ``slime_tis.kernels.correction.sequence_sums``, or ``None``
    where the kernel cannot run this call (no CUDA / interpreter, no triton, more extra tensors than it takes, a
    failed launch)."""
    correction = dispatch.triton_module("correction", "slime_tis.kernels.correction", lp_train.device, "triton")
    if correction is None or len(extra_finite) > correction.MAX_EXTRA:
        return None
    try:
        return correction.sequence_sums(lp_train, lp_rollout, valid, offsets, extra_finite)
    except dispatch.KernelLaunchError as err:
        dispatch.fall_back(err)
        return None


def token_pass_for(kernels: str) -> TokenPass | None:
    """The token pass of ``kernels`` (module docstring); ``ValueError`` naming the value if it is not one of
    ``dispatch.KERNELS``."""
    return None if dispatch.check_kernels(kernels) == "torch" else triton_token_pass
