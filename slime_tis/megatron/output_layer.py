"""The model's output mode in the hook's passes (docs/output_layer.md): ``use_fused_output_layer`` (the last stage
returns hidden states, :func:`fused_log_probs` takes ``(lp, H)`` from them), ``use_fp32_lm_head`` (float32 logits,
``fp32_logits``), ``restore_output_layer``; :func:`model_output_mode` also makes every ``Float16Module`` return the
model's dtype (docs/megatron.md, "bf16 training"). Importing this module does not import megatron-core.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from slime_tis.engine.settings import OUTPUT_LAYER_MODES
from slime_tis.kernels import dispatch
from slime_tis.kernels.output_layer import CHUNK_COLUMNS, HALF, fused_log_probs_and_entropy
from slime_tis.kernels.output_layer_support import fused_support_log_probs_and_entropy
from slime_tis.megatron.fp32_logits import fp32_logits
from slime_tis.megatron.schedule import innermost

__all__ = ["use_fused_output_layer", "use_fp32_lm_head", "restore_output_layer", "output_layer_mode",
           "output_weight", "fused_log_probs", "OUTPUT_LAYER_MODES", "model_output_mode", "returns_hidden_states",
           "float16_modules", "model_dtype_output_during", "warn_if_upcast_logits"]

_MODE_ATTR = "_tis_output_mode"
_warned = False


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _last_stage_layers(model) -> list:
    layers = []
    for chunk in _chunks(model):
        gpt = innermost(chunk)
        if getattr(gpt, "post_process", False) and getattr(gpt, "output_layer", None) is not None:
            if getattr(gpt, "mtp_process", False):
                raise ValueError("the fused output layer / float32 LM head do not support multi-token prediction "
                                 "(mtp_num_layers is set on this model)")
            layers.append(gpt.output_layer)
    return layers


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: megatron's ``copy_to_tensor_model_parallel_region``
    all-reduces ``grad.contiguous()`` in place, which loses the sum of a non-contiguous gradient."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _input_region(layer, x: Tensor) -> Tensor:
    """What ``ColumnParallelLinear`` feeds its matmul: SP all-gather, or identity whose grad is all-reduced."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )
    if layer.sequence_parallel:
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=layer.tp_group)
    elif dispatch.group_size(layer.tp_group) > 1:
        x = copy_to_tensor_model_parallel_region(x, group=layer.tp_group)
    else:
        return x
    return _ContiguousGrad.apply(x)


def _hidden_passthrough(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
    return _input_region(self, input_), None


def _fp32_forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    w = self.weight if weight is None else weight
    bias = self.bias if (self.bias is not None and not self.skip_bias_add) else None
    x = _input_region(self, input_)
    logits = fp32_logits(x, w, bias)
    gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather:
        logits = gather_from_tensor_model_parallel_region(logits, group=self.tp_group)
    return logits, (self.bias if self.skip_bias_add else None)


def _set_mode(model, mode: str | None, forward) -> int:
    layers = _last_stage_layers(model)
    for layer in layers:
        if mode is None:
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop(_MODE_ATTR, None)
        else:
            if layer.__dict__.get(_MODE_ATTR) not in (None, mode):
                raise ValueError(f"output layer already in mode {layer.__dict__[_MODE_ATTR]!r}; "
                                 "call restore_output_layer(model) first")
            layer.forward = types.MethodType(forward, layer)
            setattr(layer, _MODE_ATTR, mode)
    return len(layers)


def use_fused_output_layer(model) -> int:
    """Last-stage chunks of ``model`` (a ``GPTModel``, wrapped, or a list of chunks) return hidden states
    ``[B, S, H]``; returns how many changed. Do not pass ``labels`` to such a model."""
    return _set_mode(model, "fused", _hidden_passthrough)


def use_fp32_lm_head(model) -> int:
    """Compute the output matmul in float32 (float32 logits); returns how many chunks changed."""
    return _set_mode(model, "fp32", _fp32_forward)


def restore_output_layer(model) -> int:
    """Back to megatron's own output layer forward."""
    return _set_mode(model, None, None)


def output_layer_mode(model) -> str | None:
    """``"fused"``, ``"fp32"`` or ``None`` for the (first) last-stage chunk of ``model``."""
    layers = _last_stage_layers(model)
    return getattr(layers[0], _MODE_ATTR, None) if layers else None


@contextlib.contextmanager
def model_output_mode(model, output_layer: str | None) -> Iterator[None]:
    """The mode of one pass of the hook: the last-stage output layers of ``model`` in ``output_layer`` (``None``:
    untouched; a model already in that mode stays so on exit, one in the other mode is an error) and
    ``Float16Module`` wrappers returning the model's dtype."""
    if output_layer not in OUTPUT_LAYER_MODES:
        raise ValueError(f"output layer mode must be one of {OUTPUT_LAYER_MODES}, got {output_layer!r}")
    switch = output_layer is not None and output_layer_mode(model) != output_layer
    if switch:
        (use_fused_output_layer if output_layer == "fused" else use_fp32_lm_head)(model)
    try:
        with model_dtype_output_during(model):
            yield
    finally:
        if switch:
            restore_output_layer(model)


def returns_hidden_states(model) -> bool:
    """Whether a chunk of ``model`` has its output layer in fused mode (reads the marker only; never raises)."""
    for chunk in _chunks(model):
        layer = getattr(innermost(chunk), "output_layer", None)
        if layer is not None and getattr(layer, _MODE_ATTR, None) == "fused":
            return True
    return False


def output_weight(model) -> Tensor:
    """The weight ``GPTModel`` hands its output layer: the embedding weight when tied, else its own."""
    gpt = innermost(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def fused_log_probs(model, hidden: Tensor, labels: Tensor, *, temperature: float = 1.0,
                    loss_mask: Tensor | None = None, kernels: str = "torch", chunk_size: int = CHUNK_COLUMNS,
                    support: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(log_probs, entropy)`` float32 shaped like ``labels`` (``[B, S]`` or flat ``[B*S]``) from the hidden states
    ``[B, S, H]`` (CP-local) of a fused-mode model: the vocabulary split over the output layer's TP group, the
    hidden gradient's TP sum left to the model's input region; ``hidden`` cast to the weight's dtype. ``support``:
    the sampling-support replay (torch code only)."""
    gpt = innermost(model)
    if getattr(gpt.output_layer, _MODE_ATTR, None) != "fused":
        raise ValueError("fused_log_probs needs a model switched with use_fused_output_layer(model) "
                         "(its forward must return hidden states)")
    layer = gpt.output_layer
    group = layer.tp_group if dispatch.group_size(layer.tp_group) > 1 else None
    weight = output_weight(gpt)
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not end with the hidden size {weight.shape[1]}: "
                         "is the model's forward returning logits (use_fused_output_layer not applied)?")
    if labels.dim() == 1:
        if hidden.numel() // hidden.shape[-1] != labels.numel():
            raise ValueError(f"hidden {tuple(hidden.shape)} has {hidden.numel() // hidden.shape[-1]} positions "
                             f"but labels has {labels.numel()}")
        hidden = hidden.reshape(-1, hidden.shape[-1])
    hidden = hidden.to(weight.dtype)
    common = dict(temperature=temperature, loss_mask=loss_mask, tp_group=group, reduce_hidden_grad=False)
    with torch.autocast(hidden.device.type, enabled=False):
        if support is None:
            return fused_log_probs_and_entropy(hidden, weight, labels, kernels=kernels, chunk_size=chunk_size, **common)
        dispatch.torch_only("output_layer", kernels, "the sampling-support replay has no Triton kernel yet")
        return fused_support_log_probs_and_entropy(hidden, weight, labels, support, **common)


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
    """Inside the block, ``Float16Module`` wrappers of ``model`` default to ``fp32_output=False`` (an explicit
    ``fp32_output`` is obeyed)."""
    switched = [m for m in float16_modules(model) if "forward" not in m.__dict__]
    for m in switched:
        m.forward = types.MethodType(_forward_in_model_dtype, m)
    try:
        yield
    finally:
        for m in switched:
            m.__dict__.pop("forward", None)


def warn_if_upcast_logits(logits: Tensor, model_chunk) -> None:
    """Warn once per process when float32 logits come from a bf16 / fp16 model (dtype metadata only)."""
    global _warned
    if _warned or model_chunk is None or logits.dtype != torch.float32:
        return
    dtype = next((p.dtype for p in model_chunk.parameters()), None)
    if dtype not in HALF:
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
