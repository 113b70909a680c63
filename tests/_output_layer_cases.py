"""Shared cases of the fused output layer tests: inputs, float64 oracle, error measures.

Run as a script (``python tests/_output_layer_cases.py BACKEND``) it evaluates every case with that backend
and prints one JSON object: the test runs the Triton interpreter this way, in a subprocess whose
environment has ``TRITON_INTERPRET=1`` before triton is imported.
"""

from __future__ import annotations

import json
import sys

import torch
from _interpret import reset_dispatch
from torch import Tensor

from slime_tis.kernels.output_layer import fused_log_probs_and_entropy


def reference_log_probs_and_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0,
                                    logits_dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Plain autograd oracle (single shard, full ``[T, V]`` logits): ``logits = h W^T`` in ``logits_dtype``.

    ``logits_dtype=torch.float64`` is the test reference; ``torch.bfloat16`` with bf16 inputs reproduces the
    unfused bf16 path (logits rounded to bf16 before a float32 log-softmax).
    """
    z = (hidden.to(logits_dtype) @ weight.to(logits_dtype).t()) if logits_dtype != torch.bfloat16 \
        else hidden.bfloat16() @ weight.bfloat16().t()
    x = z.to(torch.float64 if logits_dtype == torch.float64 else torch.float32) / temperature
    log_p = torch.log_softmax(x, dim=-1)
    lp = log_p.gather(-1, targets[..., None].to(torch.int64)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return lp, ent


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
    lp, ent = fused_log_probs_and_entropy(h, w, targets, temperature=tau, loss_mask=mask, kernels=backend,
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
    lp_fused, _ = fused_log_probs_and_entropy(hidden, weight, targets, kernels=backend, chunk_size=32)
    zmax = float((hidden.double() @ weight.double().t()).abs().max())
    return {"zmax": zmax, "err_fused": float((lp_fused.double() - lp64).abs().max()),
            "err_bf16_logits": float((lp_bf16.double() - lp64).abs().max())}


def accumulation(backend: str) -> dict:
    """``dL/dh`` summed over 10 vocabulary chunks as the backward does it (bf16 ``dL/dz`` and weight chunks,
    a quarter of the rows inactive, active rows first on the Triton path): relative max error against float64
    of the float32 accumulator, of the result stored in bf16 by the last chunk, and of the earlier path
    (each chunk's product rounded to bf16, then added to a float32 sum) for scale."""
    from slime_tis.kernels import output_layer as ol

    g = torch.Generator().manual_seed(7)
    n_tok, hid, chunk, n_chunks = 40, 48, 32, 10
    d = torch.randn(n_tok, chunk * n_chunks, generator=g).bfloat16()
    w = torch.randn(chunk * n_chunks, hid, generator=g).bfloat16()
    active = torch.rand(n_tok, generator=g) > 0.25
    d[~active] = 0.0
    rows = torch.argsort((~active).to(torch.int8), stable=True)
    n_active = active.sum(dtype=torch.int32)
    exact = d.double() @ w.double()

    def summed(last_out: torch.Tensor | None) -> torch.Tensor:
        acc = torch.full((n_tok, hid), float("nan"))  # like torch.empty: the first chunk must not read it
        for i in range(n_chunks):
            dc, wc = d[:, i * chunk:(i + 1) * chunk], w[i * chunk:(i + 1) * chunk]  # dc strided, as buf[:, :C]
            out = last_out if i == n_chunks - 1 and last_out is not None else acc
            if backend == "triton":
                from slime_tis.kernels import _output_layer_triton as tk
                tk.dhidden(dc, wc, acc, out, rows, n_active, accumulate=i > 0)
            else:
                ol._torch_dhidden(dc, wc, acc, out, accumulate=i > 0)
        return acc if last_out is None else last_out

    acc = summed(None)
    final = summed(torch.full((n_tok, hid), float("nan"), dtype=torch.bfloat16))
    old = torch.zeros(n_tok, hid)
    for i in range(n_chunks):
        old += d[:, i * chunk:(i + 1) * chunk] @ w[i * chunk:(i + 1) * chunk]  # bf16 product, then added

    def rel(a):
        return float((a.double() - exact).abs().max() / exact.abs().max())

    return {"err_f32": rel(acc), "err_final_bf16": rel(final), "err_old": rel(old),
            "inactive_zero": bool((acc[~active] == 0).all() and (final[~active] == 0).all())}


def non_finite(backend: str, gpu_max: bool = False) -> dict:
    """Non-finite hidden states: which checks hold (all must be True). ``gpu_max``: the interpreter's elementwise
    max/min drop NaN as compiled CUDA code does (``_interpret.gpu_max_semantics``).

    Values: a NaN and a +inf entry in active rows give non-finite log-prob and entropy (the core then rejects
    the sequence); a masked NaN row gives 0. Gradients, with zero upstream gradient at the non-finite rows (what
    the loss gives rejected tokens) and a mask on another NaN row: finite, zero on those rows, and equal to the
    gradients of the same batch with those rows replaced by finite values.
    """
    from _interpret import gpu_max_semantics

    n_tok, hid, vocab, tau, chunk = 12, 16, 40, 0.9, 16
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(n_tok, hid, generator=g).bfloat16()
    weight = (torch.randn(vocab, hid, generator=g) * 0.5).bfloat16()
    targets = torch.randint(0, vocab, (n_tok,), generator=g)
    mask = torch.ones(n_tok)
    mask[2] = 0.0
    g_lp, g_ent = torch.randn(n_tok, generator=g), torch.randn(n_tok, generator=g)
    bad = hidden.clone()
    bad[0, 3], bad[1, 5], bad[2], bad[3, 0] = float("nan"), float("inf"), float("nan"), float("nan")

    def fused(h_in, up_lp, up_ent):
        h = h_in.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        with gpu_max_semantics(gpu_max):
            lp, ent = fused_log_probs_and_entropy(h, w, targets, temperature=tau, loss_mask=mask,
                                                  kernels=backend, chunk_size=chunk)
            (lp * up_lp + ent * up_ent).sum().backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    lp, ent, _, _ = fused(bad, g_lp, g_ent)
    finite = torch.ones(n_tok, dtype=torch.bool)
    finite[[0, 1, 3]] = False
    rejected = torch.zeros(n_tok, dtype=torch.bool)
    rejected[[0, 1, 3]] = True
    up_lp, up_ent = torch.where(rejected, 0.0, g_lp), torch.where(rejected, 0.0, g_ent)
    _, _, gh, gw = fused(bad, up_lp, up_ent)
    _, _, gh_ref, gw_ref = fused(torch.where((rejected | (mask == 0))[:, None], hidden, bad), up_lp, up_ent)
    return {
        "values_non_finite_where_the_data_is": bool(torch.equal(torch.isfinite(lp), finite)
                                                    and torch.equal(torch.isfinite(ent), finite)),
        "nan_rows_give_nan": bool(torch.isnan(lp[[0, 3]]).all() and torch.isnan(ent[[0, 3]]).all()),
        "masked_row_zero": bool(lp[2] == 0 and ent[2] == 0),
        "grads_finite": bool(torch.isfinite(gh).all() and torch.isfinite(gw).all()),
        "rejected_and_masked_rows_zero_grad": bool((gh[:4] == 0).all()),
        "grads_as_without_the_bad_rows": bool(torch.equal(gh, gh_ref) and torch.equal(gw, gw_ref)),
    }


def fallback() -> dict:
    """Triton kernels that fail to launch: the forward's (``_stats_kernel``) and, separately, the backward's
    ``dL/dh`` kernel (after the first chunk's ``dL/dz`` kernel ran): per case the fallback warnings, the
    ``run`` measures of ``bf16_tau09_masked``, and whether they equal the torch backend's."""
    import warnings

    from slime_tis.kernels import _output_layer_triton as tk
    from slime_tis.kernels import dispatch

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("out of resource: shared memory")
            return launch

    out = {}
    ref = run("bf16_tau09_masked", "torch")
    for name in ("_stats_kernel", "_dhidden_kernel"):
        real = getattr(tk, name)
        setattr(tk, name, Failing())
        reset_dispatch()
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                res = run("bf16_tau09_masked", "triton")
        finally:
            setattr(tk, name, real)
            reset_dispatch()
        msgs = [str(w.message) for w in seen if issubclass(w.category, dispatch.KernelFallbackWarning)]
        out[name] = {"warnings": msgs, "result": res, "same_as_torch": res == ref}
    return out


if __name__ == "__main__":
    import warnings

    from slime_tis.kernels.dispatch import KernelFallbackWarning

    warnings.simplefilter("error", KernelFallbackWarning)  # the Triton kernels must really run
    backend = sys.argv[1]
    out = {name: run(name, backend) for name in CASES}
    out["accuracy"] = accuracy(backend)
    out["accumulation"] = accumulation(backend)
    out["non_finite"] = non_finite(backend)
    out["non_finite_gpu_max"] = non_finite(backend, gpu_max=True)
    if backend == "triton":
        out["fallback"] = fallback()
    print(json.dumps(out))
