"""GPU acceptance, correctness part: the kernels at real sizes against the torch path and float64.

    python benchmarks/gpu_acceptance.py --json out.json        # CUDA: the sizes below; exit 1 on a failure
    python benchmarks/gpu_acceptance.py --device cpu --tiny    # smoke run of the code (Triton interpreter)

Run by ``benchmarks/gpu_acceptance.sh`` before the timings. Three checks, TP=1, temperature 0.7:

* ``logprobs``: ``vocab_parallel_log_probs_and_entropy`` on bf16 logits ``[T, V]`` = 16384 x 151936
  (``T * V`` > 2^31: 64-bit offsets), Triton kernels and torch path, against float64 ``log_softmax`` of the same
  bf16 values (chunked). Rows: clean; a -inf block (masked vocabulary entries); a -inf target; NaN off the target,
  at the target, all NaN; +inf; all -inf; masked rows (``row_mask`` 0) holding NaN. Clean and -inf-block rows:
  log-prob and entropy within 1e-4 of float64 (float32 sums over 152k entries of |logits| <= ~15) and the logit
  gradient of ``sum(g_lp lp + g_H H)`` within 4e-3 of its largest float64 entry (bf16 gradient: 2^-9 relative
  rounding plus float32). -inf target: log-prob <= -1e30 (or -inf) on both. Non-finite rows: log-prob not finite
  on both paths (NaN must reach the core's non-finite rule; the GPU's ``max`` drops NaN, the interpreter's
  does not). Masked rows: log-prob, entropy and gradient exactly 0.
* ``output_layer``: ``fused_log_probs_and_entropy`` (Triton and torch) from bf16 hidden ``[T, H]`` and weight
  ``[V, H]`` (default 4096 x 4096 x 151936) against float64 ``log_softmax(h W^T / tau)`` with autograd; a NaN
  hidden row must give a non-finite log-prob, a masked NaN row nothing (no NaN in any gradient). Tolerances: 1e-4
  on values, 2e-2 relative on the bf16 gradients (two bf16 roundings; tests/test_kernels_output_layer.py).
* ``fp32_head``: ``slime_tis.megatron.fp32_logits.fp32_logits`` (bf16 operands, float32 output, no weight copy)
  against ``F.linear(x.float(), W.float())`` and float64 at 4096 x 4096 x 151936: logits within the float32
  summation bound, gradients within it plus one bf16 rounding; peak extra memory and fwd+bwd time of both, and
  whether ``torch.mm(..., out_dtype=float32)`` ran.

Triton failures fall back to torch with a warning in the package; here that warning is an error, so a kernel
that cannot run fails its check instead of being compared with itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAU = 0.7


def _strict_kernels() -> None:
    from slime_tis.kernels.dispatch import KernelFallbackWarning

    warnings.simplefilter("error", KernelFallbackWarning)


# ------------------------------------------------------------------------------------------------ log-probs
def _logprob_rows(torch, t: int, v: int, dev: str):
    """bf16 logits with the special rows described in the module docstring; their indices by kind."""
    g = torch.Generator(device=dev).manual_seed(0)
    z = (torch.randn(t, v, device=dev, generator=g) * 2).to(torch.bfloat16)
    y = torch.randint(0, v, (t,), device=dev, generator=g)
    keep = torch.ones(t, dtype=torch.bool, device=dev)
    inf, nan = float("inf"), float("nan")
    rows = {"neg_inf_block": 0, "neg_inf_target": 1, "nan_off_target": 2, "nan_target": 3, "all_nan": 4,
            "pos_inf": 5, "all_neg_inf": 6, "masked_nan": 7}
    block = slice(v // 2, v)
    y[0] = 0
    z[0, block] = -inf
    z[1, int(y[1])] = -inf
    z[2, (int(y[2]) + 1) % v] = nan
    z[3, int(y[3])] = nan
    z[4] = nan
    z[5, (int(y[5]) + 1) % v] = inf
    z[6] = -inf
    z[7] = nan
    keep[7] = False
    keep[t // 2: t // 2 + max(1, t // 8)] = False  # a block of masked (prompt) rows
    return z, y, keep, rows


def _float64_log_probs(torch, z, y, keep, w_lp, w_h, rows_per_chunk: int):
    """float64 lp, H and dL/dz of sum(w_lp lp + w_h H), chunked over rows (masked rows: zeros)."""
    t = z.shape[0]
    lp = torch.zeros(t, dtype=torch.float64, device=z.device)
    ent = torch.zeros_like(lp)
    grad = torch.zeros(z.shape, dtype=torch.float32, device=z.device)  # float64 values, stored as float32
    for lo in range(0, t, rows_per_chunk):
        hi = min(lo + rows_per_chunk, t)
        x = (z[lo:hi].double() / TAU)
        lsm = torch.log_softmax(x, dim=-1)
        p = lsm.exp()
        plogp = torch.where(p > 0, p * lsm, torch.zeros_like(p))
        lp_c = lsm.gather(-1, y[lo:hi, None]).squeeze(-1)
        h_c = -plogp.sum(-1)
        onehot = torch.zeros_like(p).scatter_(1, y[lo:hi, None], 1.0)
        g = (w_lp[lo:hi, None].double() * (onehot - p)
             + w_h[lo:hi, None].double() * -(plogp - p * (-h_c)[:, None])) / TAU
        k = keep[lo:hi]
        lp[lo:hi] = torch.where(k, lp_c, 0.0)
        ent[lo:hi] = torch.where(k, h_c, 0.0)
        grad[lo:hi] = torch.where(k[:, None], g, 0.0).float()
        del x, lsm, p, plogp, onehot, g
    return lp, ent, grad


def check_logprobs(torch, t: int, v: int, dev: str, rows_per_chunk: int) -> dict:
    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy as lp_and_h

    z, y, keep, special = _logprob_rows(torch, t, v, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    w_lp, w_h = torch.randn(t, device=dev, generator=g), torch.randn(t, device=dev, generator=g)
    lp64, h64, grad64 = _float64_log_probs(torch, z, y, keep, w_lp, w_h, rows_per_chunk)
    clean = keep.clone()
    for name, r in special.items():
        clean[r] = name == "neg_inf_block"
    out: dict = {"shape": [t, v], "t_times_v_over_2_31": t * v / 2 ** 31, "paths": {}}
    failures = []
    for name in ("triton", "torch"):
        zz = z.clone().requires_grad_(True)
        lp, ent = lp_and_h(zz, y, temperature=TAU, tp_group=None, row_mask=keep, kernels=name)
        (grad,) = torch.autograd.grad([lp, ent], zz, [w_lp, w_h])
        lp, ent = lp.detach().double(), ent.detach().double()
        gmax, gerr = 0.0, 0.0
        for lo in range(0, t, rows_per_chunk):  # chunked: a [T, V] float32 difference would be 10 GB
            c = clean[lo:lo + rows_per_chunk]
            ref = grad64[lo:lo + rows_per_chunk][c]
            gmax = max(gmax, float(ref.abs().max()) if ref.numel() else 0.0)
            gerr = max(gerr, float((grad[lo:lo + rows_per_chunk][c].float() - ref).abs().max()) if ref.numel() else 0.0)
        res = {
            "lp_err": float((lp - lp64)[clean].abs().max()),
            "H_err": float((ent - h64)[clean].abs().max()),
            "grad_err_rel": gerr / max(gmax, 1e-30),
            "neg_inf_target_lp": float(lp[special["neg_inf_target"]]),
            "non_finite_rows_finite": [k for k in ("nan_off_target", "nan_target", "all_nan", "pos_inf",
                                                   "all_neg_inf") if math.isfinite(float(lp[special[k]]))],
            "masked_exact_zero": bool((lp[~keep] == 0).all() and (ent[~keep] == 0).all()
                                      and (grad[~keep] == 0).all()),
        }
        ok = (res["lp_err"] <= 1e-4 and res["H_err"] <= 1e-4 and res["grad_err_rel"] <= 4e-3
              and res["neg_inf_target_lp"] <= -1e30 and not res["non_finite_rows_finite"]
              and res["masked_exact_zero"])
        res["ok"] = ok
        if not ok:
            failures.append(name)
        out["paths"][name] = res
        del zz, grad, lp, ent
        if dev == "cuda":
            torch.cuda.empty_cache()
    out["failures"] = failures
    return out


# ------------------------------------------------------------------------------------------------ output layer
def check_output_layer(torch, t: int, h: int, v: int, dev: str) -> dict:
    from slime_tis.kernels.output_layer import fused_log_probs_and_entropy as fused

    g = torch.Generator(device=dev).manual_seed(2)
    hid = (torch.randn(t, h, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=g) / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (t,), device=dev, generator=g)
    keep = torch.rand(t, device=dev, generator=g) > 0.25
    nan_row, masked_nan_row = 0, 1
    keep[nan_row], keep[masked_nan_row] = True, False
    hid[nan_row, 0] = float("nan")
    hid[masked_nan_row] = float("nan")
    w_lp, w_h = torch.randn(t, device=dev, generator=g), torch.randn(t, device=dev, generator=g)
    clean = keep.clone()
    clean[nan_row] = False
    # float64 oracle on the clean rows (autograd through log_softmax of h W^T / tau)
    h64 = hid.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    lsm = torch.log_softmax((h64[clean] @ w64.t()) / TAU, -1)
    lp64 = lsm.gather(-1, y[clean, None]).squeeze(-1)
    ent64 = -(lsm.exp() * lsm).sum(-1)
    gh64, gw64 = torch.autograd.grad((lp64 * w_lp[clean]).sum() + (ent64 * w_h[clean]).sum(), [h64, w64])
    lp64, ent64 = lp64.detach(), ent64.detach()
    del lsm
    # the NaN row must not reach the weight gradient: the oracle's loss leaves it out, the kernels' loss too
    w_lp_k = torch.where(clean, w_lp, 0.0)
    w_h_k = torch.where(clean, w_h, 0.0)
    out: dict = {"shape": [t, h, v], "paths": {}}
    failures = []
    for name in ("triton", "torch"):
        hh, ww = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = fused(hh, ww, y, temperature=TAU, loss_mask=keep, tp_group=None, kernels=name)
        gh, gw = torch.autograd.grad((lp * w_lp_k).sum() + (ent * w_h_k).sum(), [hh, ww])
        res = {
            "lp_err": float((lp.detach().double()[clean] - lp64).abs().max()),
            "H_err": float((ent.detach().double()[clean] - ent64).abs().max()),
            "grad_hidden_rel": float((gh.double()[clean] - gh64[clean]).abs().max() / gh64.abs().max()),
            "grad_weight_rel": float((gw.double() - gw64).abs().max() / gw64.abs().max()),
            "nan_row_lp_finite": math.isfinite(float(lp[nan_row])),
            "grads_finite": bool(torch.isfinite(gw).all() and torch.isfinite(gh[clean]).all()),
            "masked_zero": bool((lp[~keep] == 0).all() and (ent[~keep] == 0).all()),
        }
        ok = (res["lp_err"] <= 1e-4 and res["H_err"] <= 1e-4 and res["grad_hidden_rel"] <= 2e-2
              and res["grad_weight_rel"] <= 2e-2 and not res["nan_row_lp_finite"] and res["grads_finite"]
              and res["masked_zero"])
        res["ok"] = ok
        if not ok:
            failures.append(name)
        out["paths"][name] = res
        del hh, ww, gh, gw
    out["failures"] = failures
    return out


# ------------------------------------------------------------------------------------------------ fp32 LM head
def _run_timed(torch, fn, dev: str, repeats: int) -> tuple[float, float]:
    """(median ms, peak extra GiB) of ``fn()`` (forward + backward)."""
    fn()
    times = []
    for _ in range(repeats):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = float("nan")
    if dev == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return sorted(times)[len(times) // 2], peak


def check_fp32_head(torch, t: int, h: int, v: int, dev: str, repeats: int) -> dict:
    import torch.nn.functional as F

    from slime_tis.kernels.output_layer import has_mm_out_dtype
    from slime_tis.megatron.fp32_logits import fp32_logits

    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=g) / h ** 0.5).to(torch.bfloat16)
    up = torch.randn(t, v, device=dev, generator=g)
    eps = 2.0 ** -24
    res: dict = {"shape": [t, h, v], "mm_out_dtype_kernel": has_mm_out_dtype(torch.device(dev).type)}
    grads = {}
    for name, fn in (("new", lambda a, b: fp32_logits(a, b)), ("upcast", lambda a, b: F.linear(a.float(), b.float()))):
        a, b = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        z = fn(a, b)
        z.backward(up)
        grads[name] = (z.detach(), a.grad, b.grad)
        del a, b, z

        def step(fn=fn):
            a, b = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            fn(a, b).backward(up)

        ms, peak = _run_timed(torch, step, dev, repeats)
        res[name] = {"ms": ms, "peak_extra_gib": peak}
    (z1, gx1, gw1), (z0, gx0, gw0) = grads["new"], grads["upcast"]
    bz = h * eps * (x.double().abs() @ w.double().abs().t())
    bx = v * eps * (up.double().abs() @ w.double().abs())
    bw = t * eps * (up.double().abs().t() @ x.double().abs())

    def within(a1, a0, bound) -> bool:
        a1, a0 = a1.double(), a0.double()
        return bool(((a1 - a0).abs() <= 2 * bound + 2.0 ** -8 * torch.maximum(a1.abs(), a0.abs())).all())

    res["logits_within_summation_bound"] = bool(((z1.double() - z0.double()).abs() <= 2 * bz).all())
    res["grads_within_bound"] = within(gx1, gx0, bx) and within(gw1, gw0, bw)
    zx = x.double() @ w.double().t()
    res["logits_vs_float64_within_bound"] = bool(((z1.double() - zx).abs() <= bz).all())
    res["failures"] = [k for k in ("logits_within_summation_bound", "grads_within_bound",
                                   "logits_vs_float64_within_bound") if not res[k]]
    return res


# ------------------------------------------------------------------------------------------------ summary
def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# step -> (JSON file, what every row of it must hold); the order of gpu_acceptance.sh
STEPS: dict[str, str] = {
    "carried_set": "carried_set.json",
    "correctness": "correctness.json",
    "core_no_host_sync": "core.json",
    "logprob_kernels": "logprob_kernel.json",
    "output_layer": "output_layer.json",
    "megatron_step": "megatron_step.json",
    "loss_hook_1m_tokens": "loss_hook.json",
    "correction_vs_verl": "correction.json",
}
LOGPROB_METHODS = ("plain", "torch", "triton", "verl", "liger", "verl_fused", "cce")
OUTPUT_METHODS = ("unfused", "fused", "fp32_head", "fp32_head_upcast", "verl_fused", "liger", "cce")
MEGATRON_VARIANTS = ("plain", "hook alg0", "hook alg2", "hook alg0 fp32 head", "hook alg0 fused", "hook alg0 triton")
HOOK_ROWS = ("plain_ppo", "hook alg0 (PPO)", "hook alg2 token truncate", "hook alg2 sequence mask + bn",
             "hook alg3 geometric mask + veto")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and x == x


def _f(x, fmt: str = ".3f") -> str:
    return format(x, fmt) if _num(x) else "-"


_CPU = [False]  # the smoke run: memory figures are NaN by design (no CUDA allocator)


def _need(missing: list, where: str, row: dict, keys: tuple) -> None:
    """A row must hold every column; on CUDA a value may be NaN only where the row's note says why."""
    for k in keys:
        if k not in row:
            missing.append(f"{where}: column {k!r} missing")
        elif not _num(row[k]) and not isinstance(row[k], str) and not row.get("note") and not _CPU[0]:
            missing.append(f"{where}: {k} has no value and no note")


def _steps_table(out_dir: Path) -> dict:
    """step -> {exit, seconds, limit} from gpu_acceptance.sh's steps.tsv."""
    out = {}
    path = out_dir / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, secs, limit = line.split("\t")
            out[name] = {"exit": rc, "seconds": int(secs), "limit_s": int(limit)}
    return out


def summarize(out_dir: Path) -> tuple[list[str], dict, list[str]]:
    """(markdown lines, the same as JSON, missing steps / columns) from the files of gpu_acceptance.sh."""
    missing: list[str] = []
    steps = _steps_table(out_dir)
    data = {name: _load(out_dir / f) for name, f in STEPS.items()}
    _CPU[0] = str((data["correctness"] or {}).get("device", "")).startswith("cpu")
    overview = ["| step | exit | seconds (limit) | result |", "|---|---|---|---|"]
    detail: list[str] = []
    for name in STEPS:
        st = steps.get(name)
        if st is None:
            missing.append(f"{name}: not run")
        if data[name] is None:
            missing.append(f"{name}: no {STEPS[name]}")
    # carried set
    cs = data["carried_set"] or {}
    overview_res = {"carried_set": "missing: " + ", ".join(cs.get("missing", [])) if cs.get("missing")
                    else f"{len(cs.get('modules', {}))} modules import"}
    # correctness
    corr = data["correctness"] or {"checks": {}}
    for name in ("logprobs", "output_layer", "fp32_head"):
        if name not in corr["checks"]:
            missing.append(f"correctness: check {name!r} missing")
    overview_res["correctness"] = ", ".join(f"{k} {'FAIL' if v.get('failures') else 'ok'}"
                                            for k, v in corr["checks"].items())
    core = data["core_no_host_sync"] or {"checks": {}}
    if not core["checks"]:
        missing.append("core_no_host_sync: no checks")
    overview_res["core_no_host_sync"] = (f"{len(core['checks'])} checks, {core.get('failures', '?')} failed")
    # log-prob kernels
    lp = data["logprob_kernels"] or {"rows": []}
    by: dict = {}
    for r in lp["rows"]:
        by.setdefault((r["case"], r["masked"]), {})[r["method"]] = r
    detail += ["### log-probs + entropy, forward + backward: the same bf16 logits for every method", "",
               "| case | rows masked | method | ms | x HBM floor | peak extra MiB (besides the grad) | vs plain | "
               "vs triton | note |", "|---|---|---|---|---|---|---|---|---|"]
    for (case, masked), m in by.items():
        for meth in LOGPROB_METHODS:
            r = m.get(meth)
            if r is None:
                missing.append(f"logprob_kernels {case}@{masked}: method {meth!r} missing")
                continue
            _need(missing, f"logprob_kernels {case}@{masked} {meth}", r, ("ms", "mem", "floor", "note"))
            ms, plain, tri = r.get("ms"), m.get("plain", {}).get("ms"), m.get("triton", {}).get("ms")
            ratio = lambda a, b: f"{a / b:.2f}x" if _num(a) and _num(b) and b else "-"  # noqa: E731
            detail.append(f"| {case} | {masked:.0%} | {meth} | {_f(ms)} | {ratio(ms, r.get('floor'))} | "
                          f"{_f(r.get('mem'), '.1f')} | {ratio(ms, plain)} | {ratio(ms, tri)} | {r.get('note', '')} |")
    if not by:
        missing.append("logprob_kernels: no rows")
    overview_res["logprob_kernels"] = f"{len(by)} cases x {len(LOGPROB_METHODS)} methods"
    # output layer
    ol = data["output_layer"] or {"methods": {}}
    meth = ol["methods"]
    base = meth.get("unfused", {}).get("ms")
    detail += ["", "### output layer: hidden states -> log-probs, forward + backward, the same tensors", "",
               "| method | ms | vs unfused | peak extra GiB | minus the two grads GiB | note |",
               "|---|---|---|---|---|---|"]
    for name in OUTPUT_METHODS:
        r = meth.get(name)
        if r is None:
            missing.append(f"output_layer: method {name!r} missing")
            continue
        _need(missing, f"output_layer {name}", r, ("ms", "peak_extra_gib", "peak_extra_minus_grads_gib", "note")
              if "ms" in r else ("note",))
        ratio = f"{r['ms'] / base:.2f}x" if _num(r.get("ms")) and _num(base) and base else "-"
        detail.append(f"| {name} | {_f(r.get('ms'), '.1f')} | {ratio} | {_f(r.get('peak_extra_gib'), '.2f')} | "
                      f"{_f(r.get('peak_extra_minus_grads_gib'), '.2f')} | {r.get('note', '')[:160]} |")
    overview_res["output_layer"] = f"{len(meth)} methods; {ol.get('no_host_sync', '')}"
    # megatron step
    st = data["megatron_step"] or {"variants": {}}
    var = st["variants"]
    base = var.get("plain", {}).get("ms")
    detail += ["", "### Megatron step on a bf16 megatron-core GPT vs plain PPO (target: hook alg0 <= 1.05x)", "",
               "| variant | step ms | vs plain | peak extra GiB | note |", "|---|---|---|---|---|"]
    for name in MEGATRON_VARIANTS:
        r = var.get(name)
        if r is None:
            missing.append(f"megatron_step: variant {name!r} missing")
            continue
        if "note" not in r:
            _need(missing, f"megatron_step {name}", r, ("ms", "peak_extra_gib"))
        ratio = f"{r['ms'] / base:.3f}x" if _num(r.get("ms")) and _num(base) else "-"
        detail.append(f"| {name} | {_f(r.get('ms'), '.1f')} | {ratio} | {_f(r.get('peak_extra_gib'), '.2f')} | "
                      f"{r.get('note', '')[:160]} |")
    overview_res["megatron_step"] = (f"hook alg0 / plain = {var['hook alg0']['ms'] / base:.3f}"
                                     if _num(base) and _num(var.get("hook alg0", {}).get("ms")) else "-")
    # loss hook at 1M tokens
    hk = data["loss_hook_1m_tokens"] or {"rows": {}}
    rows = hk["rows"]
    base = rows.get("plain_ppo", {}).get("s")
    detail += ["", f"### loss hook alone vs plain PPO on {hk.get('tokens', '?')} tokens of synthetic logits", "",
               "| path | total s | vs plain | peak extra MiB | host sync in the loss |", "|---|---|---|---|---|"]
    for name in HOOK_ROWS:
        r = rows.get(name)
        if r is None:
            missing.append(f"loss_hook_1m_tokens: row {name!r} missing")
            continue
        if "note" not in r:
            _need(missing, f"loss_hook_1m_tokens {name}", r, ("s", "peak_extra_mib", "host_sync"))
        ratio = f"{r['s'] / base:.2f}x" if _num(r.get("s")) and _num(base) else "-"
        detail.append(f"| {name} | {_f(r.get('s'))} | {ratio} | {_f(r.get('peak_extra_mib'), '.0f')} | "
                      f"{r.get('host_sync', r.get('note', ''))} |")
    overview_res["loss_hook_1m_tokens"] = f"{len(rows)} paths"
    # correction core vs verl
    cr = data["correction_vs_verl"] or {"rows": [], "verdicts": []}
    detail += ["", "### correction core vs verl 0.9.1's helper (same batches)", "",
               "| configuration | batch | tokens | verl ms | ours ms | verl / ours |", "|---|---|---|---|---|---|"]
    for r in cr["rows"]:
        _need(missing, f"correction_vs_verl {r.get('configuration')}", r,
              ("configuration", "batch", "tokens", "verl_ms", "ours_ms", "speedup"))
        detail.append(f"| {r.get('configuration')} | {r.get('batch')} | {r.get('tokens')} | {_f(r.get('verl_ms'))} | "
                      f"{_f(r.get('ours_ms'))} | {_f(r.get('speedup'), '.1f')}x |")
    if not cr["rows"]:
        missing.append("correction_vs_verl: no rows")
    overview_res["correction_vs_verl"] = "; ".join(cr.get("verdicts", []))[:200]
    for name in STEPS:
        stp = steps.get(name, {})
        overview.append(f"| {name} | {stp.get('exit', 'not run')} | {stp.get('seconds', '-')} "
                        f"({stp.get('limit_s', '-')}) | {overview_res.get(name, '')} |")
    lines = ["### every step", ""] + overview + [""] + detail
    if missing:
        lines += ["", "MISSING FROM THE SUMMARY: " + "; ".join(missing)]
    summary = {"steps": {n: steps.get(n) for n in STEPS}, "results": data, "missing": missing}
    return lines, summary, missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke run)")
    p.add_argument("--tokens", type=int, default=16384, help="log-prob check: rows")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--ol-tokens", type=int, default=4096, help="output-layer and fp32-head checks: rows")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="logprobs,output_layer,fp32_head", help="comma-separated checks to run")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--summary", type=Path, default=None, metavar="DIR",
                   help="write DIR/summary.md and DIR/summary.json from gpu_acceptance.sh's files in DIR, print the "
                        "table; exit 1 when a step, a method or a column is missing")
    args = p.parse_args(argv)
    if args.summary is not None:
        lines, summary, missing = summarize(args.summary)
        (args.summary / "summary.md").write_text("\n".join(lines) + "\n")
        (args.summary / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        print("\n".join(lines))
        return 1 if missing else 0
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_acceptance.py: CUDA is not available; nothing checked (use --device cpu --tiny for a smoke run)")
        return 2
    sys.path.insert(0, str(ROOT))
    _strict_kernels()
    if args.tiny:
        args.tokens, args.vocab, args.ol_tokens, args.hidden, args.repeats = 64, 300, 32, 48, 1
    dev = args.device
    chunk_rows = max(1, (1 << 27) // args.vocab)  # ~1 GiB of float64 per oracle chunk
    checks = {
        "logprobs": lambda: check_logprobs(torch, args.tokens, args.vocab, dev, chunk_rows),
        "output_layer": lambda: check_output_layer(torch, args.ol_tokens, args.hidden, args.vocab, dev),
        "fp32_head": lambda: check_fp32_head(torch, args.ol_tokens, args.hidden, args.vocab, dev, args.repeats),
    }
    results: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)",
                     "torch": torch.__version__, "checks": {}}
    failed = []
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            res = checks[name]()
        except Exception:  # a crash is a failure of that check; the others still run
            res = {"failures": ["crashed"], "error": traceback.format_exc()}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results["checks"][name] = res
        if res["failures"]:
            failed.append(name)
        print(f"[{'ok' if not res['failures'] else 'FAIL'}] {name}: " + json.dumps(
            {k: v for k, v in res.items() if k != "error"}, default=str))
        if "error" in res:
            print(res["error"])
        if dev == "cuda":
            torch.cuda.empty_cache()
    results["failed"] = failed
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
