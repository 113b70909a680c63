"""Benchmark (CUDA): fused output layer vs the unfused bf16 path, side by side with Liger and Cut Cross-Entropy.

    python benchmarks/bench_output_layer.py                    # 16k tokens, hidden 4096, vocab 152064, bf16
    python benchmarks/bench_output_layer.py --tokens 4096 --json out.json

Every method computes, from ``hidden [T, H]`` and ``weight [V, H]`` (bf16, TP=1), the per-token log-prob of the
targets, then the gradient of a weighted sum with respect to ``hidden`` and ``weight``:

* ``unfused``: ``logits = hidden @ weight^T`` (bf16 GEMM, bf16 logits ``[T, V]``), then
  ``slime_tis.megatron.vocab_parallel_log_probs_and_entropy(..., kernels="triton")`` (the Triton log-prob +
  entropy kernels of ``slime_tis/kernels/logprobs.py``);
* ``fused`` (ours): ``slime_tis.kernels.output_layer.fused_log_probs_and_entropy`` (Triton; with entropy);
* ``liger``: ``liger_kernel``'s ``LigerFusedLinearCrossEntropyLoss`` (cross-entropy only, no entropy);
* ``cce``: ``cut_cross_entropy.linear_cross_entropy`` (cross-entropy only, no entropy).
* ``fp32_head``: ``--tis-fp32-lm-head``: float32 logits from the bf16 operands
  (``slime_tis.megatron.fp32_logits``, float32-output GEMM, no weight copy), then the log-prob path;
  ``fp32_head_upcast``: the same logits as ``F.linear(hidden.float(), weight.float())`` (its first version).

The last two are imported lazily: when the package is missing the column says so. Loss: ours and unfused
``sum(g1 * lp + g2 * H)`` with random ``g1, g2``; liger / cce: their summed cross-entropy.

Reported per method: median fwd+bwd time over ``--iters`` after ``--warmup`` (CUDA events), and the peak
extra memory: ``max_memory_allocated`` during fwd+bwd minus the memory held before it (inputs), with and
without the two gradients every method must return (``dL/dhidden`` [T, H] and ``dL/dweight`` [V, H]).
Then a no-host-sync check: one fused fwd+bwd under ``torch.cuda.set_sync_debug_mode("error")``, and the
log-prob difference of fused vs a float32-logits reference on the first ``--check-rows`` rows.

Without CUDA it exits with status 2 and a message (nothing is measured on CPU; the CPU tests cover
correctness under the Triton interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy  # noqa: E402
from slime_tis.kernels.dispatch import KernelFallbackWarning  # noqa: E402
from slime_tis.kernels.output_layer import fused_log_probs_and_entropy  # noqa: E402

GIB = 2 ** 30


def method_unfused(h, w, y, g1, g2, tau):
    logits = h @ w.t()
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, y, temperature=tau, tp_group=None, kernels="triton")
    return (lp * g1).sum() + (ent * g2).sum()


def method_fused(h, w, y, g1, g2, tau):
    lp, ent = fused_log_probs_and_entropy(h, w, y, temperature=tau, tp_group=None, kernels="triton")
    return (lp * g1).sum() + (ent * g2).sum()


def _triton_log_probs(logits, y, tau):
    """The log-prob kernels ``method_unfused`` uses (``kernels="triton"``)."""
    return vocab_parallel_log_probs_and_entropy(logits, y, temperature=tau, tp_group=None, kernels="triton")


def method_fp32_head(h, w, y, g1, g2, tau):
    """``--tis-fp32-lm-head``: float32 logits from the bf16 operands (no weight copy), then the log-prob path."""
    from slime_tis.megatron.fp32_logits import fp32_logits

    lp, ent = _triton_log_probs(fp32_logits(h, w), y, tau)
    return (lp * g1).sum() + (ent * g2).sum()


def method_fp32_head_upcast(h, w, y, g1, g2, tau):
    """The fp32 LM head as first written: ``F.linear(h.float(), w.float())`` (float32 weight copy, float32 GEMM)."""
    lp, ent = _triton_log_probs(torch.nn.functional.linear(h.float(), w.float()), y, tau)
    return (lp * g1).sum() + (ent * g2).sum()


def _library(name: str, stand_in: bool):
    """A library's fused loss as a method (``benchmarks/_third_party.py``), and what it computes."""
    from _third_party import hidden_method

    fn, what = hidden_method(torch, name, stand_in)

    def method(h, w, y, g1, g2, tau):
        lp, ent, *loss = fn(h, w, y, tau)
        return loss[0] if loss else (lp * g1).sum() + (ent * g2).sum()
    return method, what


OURS = {"unfused": method_unfused, "fused": method_fused, "fp32_head": method_fp32_head,
        "fp32_head_upcast": method_fp32_head_upcast}
LIBRARIES = ("verl_fused", "liger", "cce")


def methods(stand_in: bool = False) -> dict:
    """name -> (method, what it computes); the libraries' rows: their fused losses (``_third_party.HIDDEN``)."""
    out = {name: (fn, "log-prob + entropy") for name, fn in OURS.items()}
    for name in LIBRARIES:
        out[name] = _library(name, stand_in)
    return out


def measure(fn, h0, w0, y, g1, g2, tau, iters: int, warmup: int) -> dict:
    h = h0.detach().clone().requires_grad_(True)
    w = w0.detach().clone().requires_grad_(True)

    def step():
        h.grad = w.grad = None
        fn(h, w, y, g1, g2, tau).backward()

    for _ in range(warmup):
        step()
    h.grad = w.grad = None
    times = []
    if not torch.cuda.is_available():  # --cpu-smoke: wall time, no memory figures
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return {"ms": statistics.median(times), "peak_extra_gib": float("nan"),
                "peak_extra_minus_grads_gib": float("nan")}
    torch.cuda.synchronize()
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h.grad = w.grad = None
        start.record()
        fn(h, w, y, g1, g2, tau).backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    h.grad = w.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    return {"ms": statistics.median(times), "peak_extra_gib": peak / GIB, "peak_extra_minus_grads_gib":
            (peak - grads) / GIB}


def no_host_sync(h0, w0, y, g1, g2, tau) -> str:
    if not torch.cuda.is_available():
        return "not checked (cpu)"
    h = h0.detach().clone().requires_grad_(True)
    w = w0.detach().clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        method_fused(h, w, y, g1, g2, tau).backward()
        result = "ok: no host synchronisation in fused fwd+bwd"
    except RuntimeError as exc:
        result = f"FAILED: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result


def accuracy(h, w, y, tau, rows: int) -> dict:
    with torch.no_grad():
        hs, ys = h[:rows], y[:rows]
        lp_fused, _ = fused_log_probs_and_entropy(hs, w, ys, temperature=tau, kernels="triton")
        z32 = (hs.float() @ w.float().t()) / tau
        lp_ref = torch.log_softmax(z32, -1).gather(-1, ys[:, None]).squeeze(-1)
        zb = (hs @ w.t()).float() / tau
        lp_bf16 = torch.log_softmax(zb, -1).gather(-1, ys[:, None]).squeeze(-1)
    return {"fused_vs_fp32_logits": float((lp_fused - lp_ref).abs().max()),
            "bf16_logits_vs_fp32_logits": float((lp_bf16 - lp_ref).abs().max())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check-rows", type=int, default=1024)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: tiny shapes, Triton interpreter, CPU stand-ins for the libraries; times mean nothing")
    args = p.parse_args(argv)
    warnings.simplefilter("error", KernelFallbackWarning)  # a fallback to torch must not be timed as Triton
    if args.cpu_smoke:
        args.tokens, args.hidden, args.vocab, args.iters, args.warmup, args.check_rows = 16, 32, 96, 1, 1, 8
    elif not torch.cuda.is_available():
        print("bench_output_layer: CUDA is not available; this benchmark measures GPU kernels only "
              "(correctness is covered on CPU by tests/test_kernels_output_layer.py; --cpu-smoke runs the code).",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev, dt = ("cpu" if args.cpu_smoke else "cuda"), torch.bfloat16
    h = (torch.randn(args.tokens, args.hidden, device=dev) * 0.5).to(dt)
    w = (torch.randn(args.vocab, args.hidden, device=dev) / args.hidden ** 0.5).to(dt)
    y = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    g1, g2 = torch.randn(args.tokens, device=dev), torch.randn(args.tokens, device=dev)
    logits_gib = args.tokens * args.vocab * 2 / GIB
    results = {"shape": vars(args) | {"json": None},
               "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)",
               "bf16_logits_gib": logits_gib, "methods": {}}
    for name, (fn, what) in methods(stand_in=args.cpu_smoke).items():
        try:
            results["methods"][name] = measure(fn, h, w, y, g1, g2, args.temperature, args.iters, args.warmup)
            results["methods"][name]["note"] = what
        except KernelFallbackWarning:
            raise
        except Exception as exc:  # out of memory, a library's kernel failing: noted, the others still run
            if name in OURS and not isinstance(exc, torch.OutOfMemoryError):
                raise
            results["methods"][name] = {"note": f"failed: {exc!r}"[:300] + f"; {what}"}
        if dev == "cuda":
            torch.cuda.empty_cache()
    results["no_host_sync"] = no_host_sync(h, w, y, g1, g2, args.temperature)
    results["accuracy_max_abs_lp_diff"] = accuracy(h, w, y, args.temperature, args.check_rows)
    base = results["methods"]["unfused"].get("ms")
    print(f"# {results['device']}: T={args.tokens} H={args.hidden} V={args.vocab} bf16 "
          f"(bf16 logits alone: {logits_gib:.2f} GiB)")
    print("| method | fwd+bwd ms | vs unfused | peak extra GiB | minus grads GiB | note |")
    print("|---|---|---|---|---|---|")
    for name, r in results["methods"].items():
        if "ms" in r:
            ratio = f"{r['ms'] / base:.2f}x" if base else "-"
            print(f"| {name} | {r['ms']:.1f} | {ratio} | {r['peak_extra_gib']:.2f} | "
                  f"{r['peak_extra_minus_grads_gib']:.2f} | {r['note']} |")
        else:
            print(f"| {name} | - | - | - | - | {r['note']} |")
    print(results["no_host_sync"])
    print("max |lp - lp(float32 logits)| on", args.check_rows, "rows:", results["accuracy_max_abs_lp_diff"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
