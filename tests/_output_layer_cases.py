"""Shared cases of the fused output layer tests: inputs, float64 oracle, error measures.

Run as a script (``python tests/_output_layer_cases.py BACKEND``) it evaluates every case with that backend
and prints one JSON object: the test runs the Triton interpreter this way, in a subprocess whose
environment has ``TRITON_INTERPRET=1`` before triton is imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slime_tis.kernels.output_layer import (  # noqa: E402
    fused_log_probs_and_entropy,
    reference_log_probs_and_entropy,
)

# name: (T, H, V, temperature, masked fraction, dtype, chunk)
CASES = {
    "fp32_tau1": (21, 24, 70, 1.0, 0.0, torch.float32, 32),
    "fp32_tau07_masked": (37, 24, 70, 0.7, 0.3, torch.float32, 32),
    "fp32_tau16_one_chunk": (19, 16, 33, 1.6, 0.2, torch.float32, 64),
    "bf16_tau09_masked": (29, 32, 50, 0.9, 0.25, torch.bfloat16, 16),
}


def make_case(name: str, seed: int = 0):
    n_tok, h, v, tau, masked, dtype, chunk = CASES[name]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tok, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, v, (n_tok,), generator=g)
    mask = (torch.rand(n_tok, generator=g) >= masked).float()
    mask[0] = 0.0 if masked else 1.0  # a masked first row whenever masking is on
    g_lp, g_ent = torch.randn(n_tok, generator=g), torch.randn(n_tok, generator=g)
    return hidden, weight, targets, mask, g_lp, g_ent, tau, chunk


def oracle(hidden, weight, targets, mask, g_lp, g_ent, tau):
    """float64 values, and gradients of ``sum(mask * (g_lp lp + g_ent H))`` w.r.t. hidden and weight."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    lp, ent = reference_log_probs_and_entropy(h, w, targets, temperature=tau)
    m = mask.double()
    ((lp * g_lp.double() + ent * g_ent.double()) * m).sum().backward()
    return (lp * m).detach(), (ent * m).detach(), h.grad, w.grad


def run(name: str, backend: str) -> dict:
    hidden, weight, targets, mask, g_lp, g_ent, tau, chunk = make_case(name)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fused_log_probs_and_entropy(h, w, targets, temperature=tau, loss_mask=mask, backend=backend,
                                          chunk_size=chunk)
    (lp * g_lp + ent * g_ent).sum().backward()
    lp_r, ent_r, gh_r, gw_r = oracle(hidden, weight, targets, mask, g_lp, g_ent, tau)
    masked = mask == 0

    def err(a, b):
        return float((a.detach().double() - b).abs().max())

    return {"lp": err(lp, lp_r), "ent": err(ent, ent_r),
            "grad_hidden": err(h.grad, gh_r) / float(gh_r.abs().max()),
            "grad_weight": err(w.grad, gw_r) / float(gw_r.abs().max()),
            "masked_zero": bool((lp[masked] == 0).all() and (ent[masked] == 0).all()
                                and (h.grad[masked] == 0).all()),
            "dtypes": [str(lp.dtype), str(h.grad.dtype), str(w.grad.dtype)]}


def accuracy(backend: str) -> dict:
    """Large activations (|z| up to ~50): log-prob error vs float64 of the fused path and of bf16 logits."""
    g = torch.Generator().manual_seed(3)
    n_tok, h, v = 48, 64, 96
    hidden = torch.randn(n_tok, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h ** 0.5
    z = hidden @ weight.t()
    hidden = (hidden * (50.0 / z.abs().max())).bfloat16()   # the largest |logit| is ~50
    weight = weight.bfloat16()
    targets = torch.randint(0, v, (n_tok,), generator=g)
    lp64, _ = reference_log_probs_and_entropy(hidden.double(), weight.double(), targets)
    lp_bf16, _ = reference_log_probs_and_entropy(hidden, weight, targets, logits_dtype=torch.bfloat16)
    lp_fused, _ = fused_log_probs_and_entropy(hidden, weight, targets, backend=backend, chunk_size=32)
    zmax = float((hidden.double() @ weight.double().t()).abs().max())
    return {"zmax": zmax, "err_fused": float((lp_fused.double() - lp64).abs().max()),
            "err_bf16_logits": float((lp_bf16.double() - lp64).abs().max())}


if __name__ == "__main__":
    backend = sys.argv[1]
    out = {name: run(name, backend) for name in CASES}
    out["accuracy"] = accuracy(backend)
    print(json.dumps(out))
