"""The one weight-update interface between trainer and rollout engine, and rollout staleness.

``WeightSync.push(weights, step)`` is called once before the first rollout (initial policy) and after
every optimizer step, on the engine-owning rank, with the full GPT-2-layout weights
(:func:`examples.rl.model.gather_gpt2_weights`). Implementations:

* :class:`InProcessWeightSync` - copies the tensors into the embedded engine (default, CPU runs);
* :class:`DiskWeightSync` - writes a Hugging Face GPT-2 checkpoint directory and calls SGLang's
  ``POST /update_weights_from_disk {"model_path": DIR}`` (a real SGLang server, or the embedded engine
  served over HTTP); the directory must be visible to the server (same machine or shared FS);
* :class:`LaggedWeightSync` - wraps either and forwards the version from ``lag`` pushes ago, so
  rollouts at step ``s`` come from the policy after step ``s - lag`` (``--rollout-lag k``; the initial
  weights are used until ``k`` updates exist). Its history is part of the training checkpoint.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Protocol

import torch

from examples.rl.http_client import SGLangClient
from examples.rl.model import ModelConfig, save_hf_checkpoint
from examples.rl.rollout_engine import EmbeddedEngine


class WeightSync(Protocol):
    def push(self, weights: dict[str, torch.Tensor], step: int) -> None: ...


class InProcessWeightSync:
    """Copy weights into an :class:`EmbeddedEngine` living in this process."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    def push(self, weights: dict[str, torch.Tensor], step: int) -> None:
        self.engine.load_weights(weights)


class DiskWeightSync:
    """Write a Hugging Face checkpoint ``DIR/config.json + model.safetensors`` and ask the server to reload
    from it."""

    def __init__(self, client: SGLangClient, directory: str, cfg: ModelConfig, eos_token_id: int) -> None:
        self.client, self.directory, self.cfg, self.eos = (
            client,
            os.path.abspath(directory),
            cfg,
            eos_token_id,
        )

    def push(self, weights: dict[str, torch.Tensor], step: int) -> None:
        save_hf_checkpoint(self.directory, weights, self.cfg, self.eos)
        self.client.update_weights_from_disk(self.directory)


class LaggedWeightSync:
    """Forward the weights pushed ``lag`` calls ago (``lag = 0``: pass-through)."""

    def __init__(self, inner: WeightSync, lag: int) -> None:
        if lag < 0:
            raise ValueError(f"--rollout-lag must be >= 0, got {lag}")
        self.inner, self.lag = inner, lag
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=lag + 1)

    def push(self, weights: dict[str, torch.Tensor], step: int) -> None:
        self.history.append({k: v.clone() for k, v in weights.items()})
        self.inner.push(self.history[0], step)

    def state_dict(self) -> dict:
        return {"lag": self.lag, "history": list(self.history)}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore the history and re-push the version the engine should hold now."""
        if state["lag"] != self.lag:
            raise ValueError(f"checkpoint was written with --rollout-lag {state['lag']}, resuming with {self.lag}")
        self.history = deque(state["history"], maxlen=self.lag + 1)
        if self.history:
            self.inner.push(self.history[0], step)
