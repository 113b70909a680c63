"""Log-probs: ``log pi(labels)`` from the model's output (the loss and every pass take them here), and the
forward-only pass over a step's micro-batches that records them at the current parameters.

Used for the old-log-prob recompute of algorithms 0 and 2 (``lp_old``, the "proximal" policy at the
start of the step) and skipped for algorithms 1 and 3, which use the rollout log-probs instead (unless
``--tis-rejected-denominator drop`` needs the step's kept-token count before the first backward, see
``step_totals.needs_pre_pass``). It runs megatron's own schedule with ``forward_only=True`` under
``torch.no_grad()``, so pipeline stages exchange activations exactly as in training; the log-probs
(float32, logits divided by the rollout temperature) exist on the last stage only. With an output-layer
mode (``"fused"``, ``"fp32"``) the pass runs with the model in that mode and takes the log-probs exactly as
the training loss does (:func:`output_to_log_probs`), so pi_old and pi_theta come from the same kernel.
megatron's ``Float16Module`` returns the last stage's output in the model's dtype during the pass
(``model_dtype_output.model_dtype_output_during``), as in the training step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from slime_tis.engine.batch import TISBatch
from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
from slime_tis.engine.settings import CHUNK_SIZE, LogProbSettings
from slime_tis.megatron.output_layer import model_output_mode
from slime_tis.megatron.schedule import MicroBatchCounter, replay

__all__ = ["logits_to_log_probs", "output_to_log_probs", "forward_only_log_probs", "recompute_log_probs",
           "replayed_support"]


def logits_to_log_probs(logits: Tensor, batch: TISBatch, settings: LogProbSettings, *,
                        with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``[..., V/TP]`` logits of this micro-batch -> ``lp [T]`` (and entropy) aligned with ``batch``.

    Positions outside ``batch.loss_mask`` (prompts, padding) are skipped: their log-prob and entropy are 0 and
    their logit gradient is zero (the Triton kernels, ``kernels="triton"``, do no work for them; docs/kernels.md).
    """
    vp = logits.shape[-1]
    flat = logits.reshape(-1, vp)
    if flat.shape[0] != batch.num_tokens:
        raise ValueError(
            f"logits have {flat.shape[0]} positions ({tuple(logits.shape)}) but the micro-batch's TISBatch "
            f"has {batch.num_tokens} tokens; build it with TISBatch.from_padded(..., cp_slice=True) for CP, "
            "and return [B, S_local, V/TP] logits (model called without labels)")
    return vocab_parallel_log_probs_and_entropy(flat, batch.labels, temperature=settings.temperature,
                                                chunk_size=settings.chunk_size, with_entropy=with_entropy,
                                                row_mask=batch.loss_mask, kernels=settings.kernels,
                                                support=replayed_support(batch, settings))


def replayed_support(batch: TISBatch, settings: LogProbSettings) -> tuple[Tensor, Tensor] | None:
    """The micro-batch's sampling support when the log-probs replay it (``settings.sampling_support``: ``"replay"``,
    or ``None`` and the batch carries one), else ``None`` (full vocabulary). ``"replay"`` without a support in the
    batch is an error naming the flag."""
    if settings.sampling_support == "full" or (batch.support_ids is None and settings.sampling_support is None):
        return None
    if batch.support_ids is None:
        raise ValueError("--tis-sampling-support replay (sampling_support='replay') but the micro-batch's TISBatch "
                         "carries no support (support_ids / support_offsets): parse the rollouts with "
                         "sampling_support=True, or use --tis-sampling-support full")
    return batch.support_ids, batch.support_offsets


def output_to_log_probs(output_tensor: Tensor, batch: TISBatch, settings: LogProbSettings, *, model_chunk=None,
                        with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """The model's output for one micro-batch -> ``lp [T]`` (and entropy), per output-layer mode
    (``settings.output_layer``):

    * ``None`` / ``"fp32"``: ``output_tensor`` are the logits ``[..., V/TP]`` (float32 in ``"fp32"`` mode):
      :func:`logits_to_log_probs`;
    * ``"fused"``: ``output_tensor`` are the hidden states ``[B, S, H]`` the fused-mode model returned:
      ``fused_log_probs(model_chunk, hidden, labels, temperature, loss_mask)`` with the chunk's (tied) output
      weight (``slime_tis.megatron.output_layer``); no logits tensor, float32 accumulation.

    ``settings.kernels`` (``TISConfig.kernels``): ``"torch"`` or ``"triton"`` for either function. Masked positions get
    ``lp = H = 0`` either way. A chunk switched to fused mode behind the hook's back
    (``output_layer`` not ``"fused"``) is an error: its hidden states would be read as logits. Float32 logits
    from a bf16 / fp16 model in mode ``None`` warn once (``model_dtype_output.warn_if_upcast_logits``).
    """
    from slime_tis.megatron.model_dtype_output import warn_if_upcast_logits
    from slime_tis.megatron.output_layer import fused_log_probs, returns_hidden_states

    if settings.output_layer == "fused":
        if model_chunk is None:
            raise ValueError("output_layer='fused' needs the model chunk (its output weight) in the loss function")
        lp, entropy = fused_log_probs(model_chunk, output_tensor, batch.labels, temperature=settings.temperature,
                                      loss_mask=batch.loss_mask, kernels=settings.kernels,
                                      support=replayed_support(batch, settings))
        return lp, (entropy if with_entropy else None)
    if model_chunk is not None and returns_hidden_states(model_chunk):
        raise ValueError("the model's output layer returns hidden states (use_fused_output_layer was applied) "
                         "but the hook was built without fused_output_layer=True (--tis-fused-output-layer)")
    if settings.output_layer is None:
        warn_if_upcast_logits(output_tensor, model_chunk)
    return logits_to_log_probs(output_tensor, batch, settings, with_entropy=with_entropy)


def recompute_log_probs(forward_backward_func: Callable, forward_step_func: Callable, items: Any,
                        model: Any, *,
                        batches: list[TISBatch] | None, num_microbatches: int, vpp: bool,
                        temperature: float = 1.0, chunk_size: int = CHUNK_SIZE, output_layer: str | None = None,
                        kernels: str = "torch", **schedule_kwargs: Any) -> list[Tensor] | None:
    """``[lp_k [T_k] for each micro-batch k]`` on the last pipeline stage, ``None`` elsewhere: one forward-only
    pass (:func:`forward_only_log_probs`) with the model in its output mode (``output_layer.model_output_mode``).

    Args:
        forward_backward_func: megatron's schedule (``get_forward_backward_func()``).
        forward_step_func: the launcher's ``forward_step(data_iterator, model)`` returning ``(logits, _)``.
        items: the step's materialised micro-batch items (list, or list of lists for virtual stages).
        batches: this rank's ``TISBatch`` per micro-batch (last stage), else ``None``.
        temperature, chunk_size, output_layer, kernels: the :class:`~slime_tis.engine.settings.LogProbSettings`
            of the pass (``output_layer``: ``None``, ``"fp32"`` or ``"fused"``; ``kernels``: ``TISConfig.kernels``).
        schedule_kwargs: forwarded to the schedule (``seq_length``, ``micro_batch_size``, ...).
    """
    settings = LogProbSettings(temperature, chunk_size, output_layer, kernels)
    with model_output_mode(model, settings.output_layer):
        return forward_only_log_probs(forward_backward_func, forward_step_func, items, model, batches=batches,
                                      num_microbatches=num_microbatches, vpp=vpp, settings=settings,
                                      **schedule_kwargs)


def forward_only_log_probs(forward_backward_func: Callable, forward_step_func: Callable, items: Any, model: Any, *,
                           batches: list[TISBatch] | None, num_microbatches: int, vpp: bool,
                           settings: LogProbSettings, **schedule_kwargs: Any) -> list[Tensor] | None:
    """:func:`recompute_log_probs` inside the caller's ``model_output_mode`` (the hook's step, a rollout pass)."""
    results: list[Tensor | None] = [None] * num_microbatches
    counter = MicroBatchCounter()

    def forward_step(data_iterator, model_chunk, *args, **kwargs):
        index = counter.next_index(model_chunk)
        output, _ = forward_step_func(data_iterator, model_chunk, *args, **kwargs)

        def loss_func(output_tensor: Tensor, non_loss_data: bool = False):
            if batches is None:
                raise RuntimeError("recompute: loss on a rank without TISBatch micro-batches "
                                   "(not the last stage?)")
            lp, _ = output_to_log_probs(output_tensor, batches[index], settings, model_chunk=model_chunk,
                                        with_entropy=False)
            results[index] = lp.detach()
            return torch.zeros((), dtype=torch.float32, device=lp.device), {}

        return output, loss_func

    with torch.no_grad():
        forward_backward_func(forward_step_func=forward_step, data_iterator=replay(items, vpp), model=model,
                              num_microbatches=num_microbatches, forward_only=True, **schedule_kwargs)
    if batches is None:
        return None
    if any(r is None for r in results):
        raise RuntimeError("recompute: the schedule did not compute the loss of every micro-batch")
    return results  # type: ignore[return-value]
