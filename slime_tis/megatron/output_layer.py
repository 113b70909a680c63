"""megatron-core 0.16 glue: the fused output layer and the float32 LM head (see docs/output_layer.md).

Two modes for a ``GPTModel``'s output layer (a vocab-parallel ``ColumnParallelLinear``), switched on the
model instance once after it is built (only chunks holding the pipeline's last stage have one):

* ``use_fused_output_layer(model)``: the output layer returns its *input* (after the same tensor-parallel
  input region megatron applies: sequence-parallel all-gather, or identity with a gradient all-reduce),
  so ``model(tokens, position_ids, None)`` returns the hidden states ``[B, S, H]`` instead of the logits.
  :func:`fused_log_probs` then computes ``(log_probs, entropy)`` from them and :func:`output_weight`
  (the embedding weight when tied) with :func:`slime_tis.kernels.output_layer.fused_log_probs_and_entropy`:
  no logits tensor, float32 accumulation.
* ``use_fp32_lm_head(model)``: the unfused path with float32 logits: the output matmul multiplies the bf16
  hidden states and weight with float32 accumulation and float32 output (:func:`slime_tis.megatron.fp32_logits.
  fp32_logits`: the values of the float32 GEMM of the upcast operands, on tensor cores, no float32 copy of the
  weight), and the log-prob path keeps them float32. Costs float32 logits (2x the bf16 logits).

``restore_output_layer(model)`` undoes either. The hook switches the mode only around its own passes
(:func:`model_output_mode`, the one place a pass enters the model's output mode: this output-layer mode and
``model_dtype_output``'s model-dtype logits; ``engine.settings.output_layer_of`` turns the two flags into the
mode).
Importing this module does not import megatron-core.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.engine.settings import OUTPUT_LAYER_MODES
from slime_tis.kernels.output_layer import fused_log_probs_and_entropy
from slime_tis.megatron.fp32_logits import fp32_logits
from slime_tis.megatron.model_dtype_output import model_dtype_output_during

__all__ = ["use_fused_output_layer", "use_fp32_lm_head", "restore_output_layer", "output_layer_mode",
           "output_weight", "fused_log_probs", "OUTPUT_LAYER_MODES", "output_layer_mode_during",
           "model_output_mode", "returns_hidden_states"]

_MODE_ATTR = "_tis_output_mode"


def _unwrap(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers (their ``.module`` chain)."""
    while hasattr(model, "module") and not hasattr(model, "output_layer"):
        model = model.module
    return model


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _last_stage_layers(model) -> list:
    layers = []
    for chunk in _chunks(model):
        gpt = _unwrap(chunk)
        if getattr(gpt, "post_process", False) and getattr(gpt, "output_layer", None) is not None:
            if getattr(gpt, "mtp_process", False):
                raise ValueError("the fused output layer / float32 LM head do not support multi-token prediction "
                                 "(mtp_num_layers is set on this model)")
            layers.append(gpt.output_layer)
    return layers


def _tp_size(layer) -> int:
    group = getattr(layer, "tp_group", None)
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


class _ContiguousGrad(torch.autograd.Function):
    """Identity; backward makes the incoming gradient contiguous.

    megatron's ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` in place and
    returns ``grad``: for a non-contiguous gradient (ours arrives through ``GPTModel``'s ``transpose(0, 1)``)
    the sum lands in a temporary and is lost. The stock linear always hands it a contiguous gradient.
    """

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
    elif _tp_size(layer) > 1:
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
    """Make the model return hidden states ``[B, S, H]`` (last stage); returns how many chunks changed.

    ``model``: a ``GPTModel``, a wrapped one, or the list of model chunks. Chunks without the last stage
    are left alone. Do not pass ``labels`` to such a model (its own loss would see hidden states).
    """
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
def output_layer_mode_during(model, mode: str | None) -> Iterator[None]:
    """The last-stage output layer(s) of ``model`` in ``mode`` inside the block, as before afterwards.

    ``None`` leaves the model alone. A model already in ``mode`` (the launcher switched it itself) stays so
    on exit; a model in the other mode is an error (``use_*`` refuses to switch blindly)."""
    if mode not in OUTPUT_LAYER_MODES:
        raise ValueError(f"output layer mode must be one of {OUTPUT_LAYER_MODES}, got {mode!r}")
    if mode is None or output_layer_mode(model) == mode:
        yield
        return
    (use_fused_output_layer if mode == "fused" else use_fp32_lm_head)(model)
    try:
        yield
    finally:
        restore_output_layer(model)


@contextlib.contextmanager
def model_output_mode(model, output_layer: str | None) -> Iterator[None]:
    """The model's output mode for a pass of the step (the loss's forward, a pi_old pass): its last-stage output
    layer in ``output_layer`` (:func:`output_layer_mode_during`) and its ``Float16Module`` wrappers returning
    the model's dtype (``model_dtype_output``). Every pass enters the mode here, once."""
    with output_layer_mode_during(model, output_layer), model_dtype_output_during(model):
        yield


def returns_hidden_states(model) -> bool:
    """Whether a chunk of ``model`` has its output layer in fused mode (reads the marker only; never raises,
    also for models this glue refuses, e.g. with multi-token prediction)."""
    for chunk in _chunks(model):
        layer = getattr(_unwrap(chunk), "output_layer", None)
        if layer is not None and getattr(layer, _MODE_ATTR, None) == "fused":
            return True
    return False


def output_weight(model) -> Tensor:
    """The weight ``GPTModel`` hands its output layer: the embedding weight when tied, else its own."""
    gpt = _unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def fused_log_probs(model, hidden: Tensor, labels: Tensor, *, temperature: float = 1.0,
                    loss_mask: Tensor | None = None, kernels: str = "torch",
                    chunk_size: int = 8192, support: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(log_probs, entropy)`` float32, shaped like ``labels``, from the hidden states a fused-mode model returned.

    ``hidden [B, S, H]`` (CP-local, like the logits it replaces); ``labels`` global token ids, ``[B, S]`` or
    flat ``[B*S]`` (a ``TISBatch``'s ``labels``; ``loss_mask`` shaped alike). The vocabulary is split over the
    output layer's TP group (one MAX and one SUM all-reduce of ``[B*S]`` / ``[B*S, 3]``); the hidden-state
    gradient is summed over TP by the input region of the model's forward. ``hidden`` is cast to the weight's
    dtype first (megatron's ``Float16Module`` hands the last stage's output back as float32). ``kernels``:
    ``"torch"`` or ``"triton"`` (``TISConfig.kernels``, ``slime_tis.kernels.dispatch``). ``support``: the
    sampling-support replay over the flattened positions (``slime_tis.kernels.output_layer_support``, torch code;
    ``kernels="triton"`` warns once and runs it).
    """
    gpt = _unwrap(model)
    if getattr(gpt.output_layer, _MODE_ATTR, None) != "fused":
        raise ValueError("fused_log_probs needs a model switched with use_fused_output_layer(model) "
                         "(its forward must return hidden states)")
    layer = gpt.output_layer
    group = layer.tp_group if _tp_size(layer) > 1 else None
    weight = output_weight(gpt)
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not end with the hidden size {weight.shape[1]}: "
                         "is the model's forward returning logits (use_fused_output_layer not applied)?")
    if labels.dim() == 1:
        if hidden.numel() // hidden.shape[-1] != labels.numel():
            raise ValueError(f"hidden {tuple(hidden.shape)} has {hidden.numel() // hidden.shape[-1]} positions "
                             f"but labels has {labels.numel()}")
        hidden = hidden.reshape(-1, hidden.shape[-1])
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    if support is not None:
        from slime_tis.kernels import dispatch
        from slime_tis.kernels.output_layer_support import fused_support_log_probs_and_entropy

        dispatch.torch_only("output_layer", kernels, "the sampling-support replay has no Triton kernel yet")
        with torch.autocast(hidden.device.type, enabled=False):
            return fused_support_log_probs_and_entropy(hidden, weight, labels, support, temperature=temperature,
                                                       loss_mask=loss_mask, tp_group=group, reduce_hidden_grad=False)
    with torch.autocast(hidden.device.type, enabled=False):
        return fused_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, loss_mask=loss_mask,
                                           tp_group=group, reduce_hidden_grad=False, kernels=kernels,
                                           chunk_size=chunk_size)
