"""The last stage's output in the dtype the model computes it: no float32 copy of bf16 logits for the loss.

megatron-core's ``Float16Module`` (the bf16 / fp16 wrapper) upcasts the last pipeline stage's output to float32
unless it is called with ``fp32_output=False``. For the logits ``[B, S, V/TP]`` that is a float32 copy (4 bytes
per entry, 9.7 GB at 16k tokens x 152k vocabulary) written by the forward, read by the log-prob kernel instead
of the bf16 logits (twice the bytes: at 16k x 152k the H100 bandwidth floor of the kernel's forward + backward
goes from about 4.5 ms to 8.9 ms), held until the backward, and a float32 gradient cast back to bf16. The log-prob path
computes in float32 whatever it reads, and a bf16 -> float32 upcast is exact, so the log-probs, the entropy
and the bf16 logit gradient are bit-for-bit those of the upcast logits.

* :func:`model_dtype_output_during`: around the hook's own schedule calls (training step, pi_old passes), every
  ``Float16Module`` in the model chunks' wrapper chain defaults to ``fp32_output=False`` (instance-level, undone
  afterwards); a ``forward_step`` that passes ``fp32_output`` itself is obeyed.
* :func:`warn_if_upcast_logits`: the loss path's check (dtype metadata only, no host sync): float32 logits from
  a model whose output weight is bf16 / fp16 warn once, naming the way out.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["model_dtype_output_during", "warn_if_upcast_logits", "float16_modules"]

_HALF = (torch.bfloat16, torch.float16)
_warned = False


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def float16_modules(model) -> list[torch.nn.Module]:
    """megatron-core ``Float16Module`` instances in the ``.module`` wrapper chains of ``model``'s chunks."""
    try:
        from megatron.core.transformer.module import Float16Module
    except ImportError:
        return []
    found = []
    for chunk in _chunks(model):
        inner = chunk
        while isinstance(inner, torch.nn.Module):
            if isinstance(inner, Float16Module):
                found.append(inner)
            inner = getattr(inner, "module", None)
    return found


def _forward_in_model_dtype(self, *inputs: Any, fp32_output: bool = False, **kwargs: Any):
    return type(self).forward(self, *inputs, fp32_output=fp32_output, **kwargs)


@contextlib.contextmanager
def model_dtype_output_during(model) -> Iterator[None]:
    """Inside the block, ``Float16Module`` wrappers of ``model`` return the model's dtype (module docstring)."""
    switched = [m for m in float16_modules(model) if "forward" not in m.__dict__]
    for m in switched:
        m.forward = types.MethodType(_forward_in_model_dtype, m)
    try:
        yield
    finally:
        for m in switched:
            m.__dict__.pop("forward", None)


def _model_dtype(model_chunk) -> torch.dtype | None:
    for p in model_chunk.parameters():
        return p.dtype
    return None


def warn_if_upcast_logits(logits: Tensor, model_chunk) -> None:
    """Warn once per process when float32 logits come from a bf16 / fp16 model (module docstring)."""
    global _warned
    if _warned or model_chunk is None or logits.dtype != torch.float32:
        return
    dtype = _model_dtype(model_chunk)
    if dtype not in _HALF:
        return
    _warned = True
    warnings.warn(
        f"the loss reads float32 logits {tuple(logits.shape)} from a {dtype} model: an upcast copy (twice the "
        "bytes of the model's logits, written, held for the backward and read by the log-prob kernel). The "
        "log-prob path computes in float32 from any input dtype and the upcast is exact, so return the logits in "
        "the model's dtype: megatron-core's Float16Module upcasts unless called with fp32_output=False (the hook "
        "sets that default in its own passes; do not pass fp32_output=True in forward_step), and forward_step "
        "should not call .float() on them. For float32 logits from a float32-accumulated LM head use "
        "--tis-fp32-lm-head (fp32_lm_head=True) instead.", stacklevel=3)
