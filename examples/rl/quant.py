"""Weight-only quantisation of the rollout engine's linear layers (the engine side of a quantized rollout).

A quantized rollout engine (int8 / fp8 weights, as in FlashRL-style deployments) stores each linear
weight ``W`` as a low-precision code ``q`` plus a float32 scale ``s`` and multiplies with the dequantized
``W_hat = q * s`` in its compute dtype; training keeps the float32 weights, so ``W_hat - W`` is a
training/inference mismatch on top of the bf16 one.

Weights here are in the GPT-2 Conv1D layout ``[in, out]`` (``y = x @ W``); "per output channel" means one
scale per column: ``s[j] = max_i |W[i, j]| / Q_MAX`` (shape ``[1, out]``), "per tensor" one scalar.

* int8, symmetric: ``q = clamp(round(W / s), -127, 127)`` (``Q_MAX = 127``; round half to even), int8 codes;
* fp8 e4m3: ``q = float8_e4m3fn(W / s)`` (``Q_MAX = 448``, the largest finite e4m3 value; the cast rounds to
  nearest even on the e4m3 grid), stored as ``torch.float8_e4m3fn``.

An all-zero channel gets scale 1 (its codes are 0), so no division by zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: quantisation schemes of ``--engine-quant``: name -> (code dtype, largest code, scale granularity)
SCHEMES: dict[str, tuple[torch.dtype, float, str]] = {
    "int8": (torch.int8, 127.0, "channel"),
    "fp8": (torch.float8_e4m3fn, 448.0, "channel"),
    "fp8-tensor": (torch.float8_e4m3fn, 448.0, "tensor"),
}
ENGINE_QUANT_CHOICES = ("none", *SCHEMES)


@dataclass(frozen=True)
class QuantizedWeight:
    """``codes [in, out]`` (int8 or float8_e4m3fn) and float32 ``scale`` (``[1, out]`` or ``[1, 1]``)."""

    codes: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_hat = codes * scale`` computed in float32, then rounded once to the compute ``dtype``."""
        return (self.codes.to(torch.float32) * self.scale).to(dtype)


def quantize(w: torch.Tensor, scheme: str) -> QuantizedWeight:
    """Quantize a ``[in, out]`` weight with ``scheme`` (a key of :data:`SCHEMES`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"engine quantisation scheme must be one of {ENGINE_QUANT_CHOICES}, got {scheme!r}")
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D [in, out] weight, got shape {tuple(w.shape)}")
    code_dtype, q_max, granularity = SCHEMES[scheme]
    w = w.detach().to(torch.float32)
    amax = w.abs().amax(dim=0, keepdim=True) if granularity == "channel" else w.abs().amax().view(1, 1)
    scale = torch.where(amax > 0, amax / q_max, torch.ones_like(amax))
    x = w / scale
    if code_dtype == torch.int8:
        codes = torch.round(x).clamp(-q_max, q_max).to(torch.int8)
    else:
        codes = x.clamp(-q_max, q_max).to(code_dtype)
    return QuantizedWeight(codes, scale)


def is_quantized_linear(name: str) -> bool:
    """The GPT-2 weights a weight-only scheme quantizes: the four linear layers of every block, and every MoE
    expert's two (embeddings, LayerNorms, biases, the MoE router and the tied LM head stay in the compute
    dtype)."""
    return name.endswith(("attn.c_attn.weight", ".c_proj.weight", ".c_fc.weight"))
