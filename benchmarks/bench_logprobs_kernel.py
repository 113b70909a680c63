"""Benchmark (CUDA): the fused Triton log-prob + entropy kernels vs the chunked torch path and Liger-Kernel.

    python benchmarks/bench_logprobs_kernel.py                       # the issue's cases, one table
    python benchmarks/bench_logprobs_kernel.py --write docs/kernels.md --label "H100 SXM"
    python benchmarks/bench_logprobs_kernel.py --sweep               # also time block sizes x warps
    python benchmarks/bench_logprobs_kernel.py --cpu-smoke           # no GPU: tiny shapes, interpreter, no timing

Work per case: ``T`` tokens x ``V`` vocabulary, bfloat16 logits, TP=1, temperature 0.7, forward + backward
with entropy (upstream gradients random for both outputs), the same tensors for every method, one row each
(``METHODS``; the libraries' entry points are in ``benchmarks/_third_party.py``):

* ``plain``: ``torch.log_softmax(z.float() / tau).gather`` + entropy with autograd: what every user has;
* ``torch``: ``vocab_parallel_log_probs_and_entropy(..., kernels="torch", row_mask=...)`` (this package's chunked
  torch path, ``--chunk-size`` rows; the reference);
* ``triton``: the same function with ``kernels="triton"`` (this package's kernels);
* ``verl``: verl 0.9.1's ``logprobs_from_logits`` + ``entropy_from_logits`` of ``z / tau`` (its torch path: the
  image has no flash-attn);
* ``liger``: Liger-Kernel's ``LigerCrossEntropyLoss(reduction="sum")`` (cross-entropy only: no entropy, no
  temperature; masked rows as ``ignore_index``); it writes the gradient over its input in the forward;
* ``verl_fused``, ``cce``: verl's fused kernel and Cut Cross-Entropy take hidden states and a weight, not logits:
  a row saying so (they are timed by ``bench_output_layer.py``).

Methods without a row mask get zero upstream gradients on masked rows. A method slower than 0.2 s per call is
timed 3 times. ``--cpu-smoke``: a library that cannot run on CPU is replaced by the same loss in plain torch and
its note says so.

Reported: median CUDA-event time of ``--repeats`` runs after a warm-up (two runs for a method slower than
0.2 s); ``x floor``: that time over the bandwidth floor (bytes read and written by one forward read, one
backward read and one gradient write of the active rows, the gradient write of all rows, at ``--bandwidth``
GB/s); peak extra memory besides the logits gradient (``max_memory_allocated`` during the last timed run minus
the allocation before it, minus ``T x V`` gradient bytes where the method allocates one); whether forward +
backward ran under
``torch.cuda.set_sync_debug_mode("error")``. Before timing, triton and torch are compared on every case.

Targets: 16k x 32k <= 2 ms and no slower than Liger; 16k x 152k <= 8 ms; half rows masked <= 0.6x
of all rows. Without a GPU the script exits with a message (nothing is measured); ``--cpu-smoke`` runs
its code paths on tiny shapes under ``TRITON_INTERPRET=1`` (times there mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_logprobs_kernel:begin -->", "<!-- bench_logprobs_kernel:end -->"
TAU = 0.7


def _parse_shapes(text: str) -> list[tuple[int, int, float]]:
    """``"16384x32000,16384x32000@0.5"`` -> [(T, V, masked fraction)]."""
    out = []
    for item in text.split(","):
        shape, _, frac = item.partition("@")
        t, v = (int(x) for x in shape.lower().split("x"))
        out.append((t, v, float(frac or 0.0)))
    return out


def _need_cuda(cpu_smoke: bool):
    if cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    try:
        import torch
    except ImportError:
        sys.exit("bench_logprobs_kernel.py: torch is not installed")
    if not cpu_smoke and not torch.cuda.is_available():
        sys.exit("bench_logprobs_kernel.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("bench_logprobs_kernel.py needs triton (pip install triton): nothing measured")
    import warnings

    from slime_tis.kernels.dispatch import KernelFallbackWarning
    warnings.simplefilter("error", KernelFallbackWarning)  # a fallback to torch must not be timed as "triton"
    return torch


def _median_ms(torch, fn, repeats: int) -> float:
    return _time_and_peak(torch, fn, repeats, 0)[0]


def _time_and_peak(torch, fn, repeats: int, grad_bytes: int) -> tuple[float, float]:
    """(median ms, peak extra MiB besides ``grad_bytes``) of ``fn``: one warm-up (compiles), then ``repeats`` runs
    (CUDA events), the peak memory read during the last one. A method slower than 0.2 s per call (verl's row-wise
    bf16 path, say) is timed twice, its second call (host clock, synchronised) counting as the first sample."""
    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    second = (time.perf_counter() - t0) * 1e3
    times, peak = [], float("nan")
    if second > 200:
        times, repeats = [second], 1
    for i in range(repeats):
        if not cuda:  # --cpu-smoke
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        if i == repeats - 1:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if i == repeats - 1:
            peak = (torch.cuda.max_memory_allocated() - base - grad_bytes) / 2**20
    return statistics.median(times), peak


def _sync_free(torch, fn) -> str:
    if not torch.cuda.is_available():
        return "-"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        verdict = "yes"
    except RuntimeError as err:
        verdict = f"no ({str(err).splitlines()[0][:60]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return verdict


METHODS = ("plain", "torch", "triton", "verl", "liger", "verl_fused", "cce")  # the rows of every case, in order


def _methods(torch, args, logits, targets, keep, w_lp, w_h):
    """name -> (callable running forward + backward or None, allocates a [T, V] gradient?, note)."""
    from _third_party import logits_method

    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy as lp_and_h

    mask = None if bool(keep.all()) else keep  # host read here, outside every timed region
    g_lp, g_h = w_lp * keep, w_h * keep  # the competitors have no row mask: masked rows get no upstream gradient

    def ours(kernels: str):
        def run():
            lp, ent = lp_and_h(logits, targets, temperature=TAU, tp_group=None, row_mask=mask, kernels=kernels,
                               chunk_size=args.chunk_size)
            return torch.autograd.grad([lp, ent], logits, [w_lp, w_h])[0]
        return run

    methods = {}
    for name in METHODS:
        if name in ("torch", "triton"):
            methods[name] = (ours(name), True, "this package" + (" (reference)" if name == "torch" else ""))
            continue
        fn, note = logits_method(torch, name, stand_in=args.cpu_smoke)
        if fn is None:
            methods[name] = (None, False, note)
        elif name == "liger":  # cross-entropy only; it overwrites its input with the gradient on every call
            liger_in = logits.detach().clone().requires_grad_(True)
            liger_targets = torch.where(keep, targets, -100)

            def liger(fn=fn, liger_in=liger_in, liger_targets=liger_targets):
                return torch.autograd.grad(fn(liger_in, liger_targets, TAU)[-1], liger_in)[0]
            methods[name] = (liger, "stand-in" in note, note)
        else:
            def run(fn=fn):
                lp, ent = fn(logits, targets, TAU)
                return torch.autograd.grad([lp, ent], logits, [g_lp, g_h])[0]
            methods[name] = (run, True, note)
    return methods


def _check(torch, logits, targets, keep) -> str:
    """triton vs torch on this case: max |d lp|, |d H| (float32), max |d grad| / max |grad| (bf16 grads)."""
    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy as lp_and_h

    out = {}
    for kernels in ("triton", "torch"):
        lp, ent = lp_and_h(logits, targets, temperature=TAU, tp_group=None, row_mask=keep, kernels=kernels)
        out[kernels] = (lp.detach(), ent.detach(), torch.autograd.grad(lp.sum() + ent.sum(), logits)[0].float())
    err = [float((a - b).abs().max()) for a, b in zip(out["triton"], out["torch"])]
    err[2] /= float(out["torch"][2].abs().max().clamp(min=1e-30))
    if err[0] > 1e-3 or err[1] > 1e-3 or err[2] > 2**-6:
        raise AssertionError(f"triton and torch disagree: |d lp| {err[0]:.3g}, |d H| {err[1]:.3g}, "
                             f"grad relative {err[2]:.3g}")
    return f"vs torch: lp {err[0]:.0e}, H {err[1]:.0e}, grad {err[2]:.0e}"


def run_case(torch, args, t: int, v: int, masked: float) -> list[dict]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(t, v, device=dev, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, v, (t,), device=dev, generator=g)
    # prompts as contiguous blocks: the first `masked` fraction of every 1024-token sequence is masked out
    seq = min(1024, t)
    keep = (torch.arange(t, device=dev) % seq) >= int(round(masked * seq))
    w_lp, w_h = torch.randn(t, device=dev, generator=g), torch.randn(t, device=dev, generator=g)
    note = _check(torch, logits, targets, keep)
    methods = _methods(torch, args, logits, targets, keep, w_lp, w_h)
    n_active = int(keep.sum())
    grad_bytes = t * v * logits.element_size()
    floor_ms = (2 * n_active * v * logits.element_size() + grad_bytes) / (args.bandwidth * 1e9) * 1e3
    rows = []
    for name, (fn, allocates_grad, what) in methods.items():
        base = dict(case=f"{t}x{v}", masked=masked, method=name, floor=floor_ms, note=what)
        if fn is None:
            rows.append(base | dict(ms=float("nan"), mem=float("nan"), sync="-"))
            continue
        try:
            ms, mem = _time_and_peak(torch, fn, args.repeats, grad_bytes if allocates_grad else 0)
        except Exception as err:  # out of memory, or a third-party kernel failing: noted, not fatal
            if name in ("triton", "torch"):
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            why = "out of memory" if isinstance(err, torch.OutOfMemoryError) else f"failed: {err!r}"[:160]
            rows.append(base | dict(ms=float("nan"), mem=float("nan"), sync="-", note=f"{why}; {what}"))
            continue
        sync = _sync_free(torch, fn) if name in ("triton", "torch") else "-"
        rows.append(base | dict(ms=ms, mem=mem, sync=sync, note=f"{what}; {note}" if name == "triton" else what))
    del logits
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def sweep(torch, args, t: int, v: int) -> list[str]:
    """Time the kernel alone for block sizes x warps on one shape (tuning aid)."""
    from slime_tis.kernels.logprobs import fused_log_probs_and_entropy

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(t, v, device=dev, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, v, (t,), device=dev, generator=g)
    w = torch.randn(t, device=dev, generator=g)
    blocks, warps_list = ((1024, 2048, 4096, 8192, 16384), (4, 8, 16, 32)) if dev == "cuda" else ((16,), (4,))
    lines = [f"sweep {t}x{v}: | BLOCK_V | warps | fwd+bwd ms |", "|---|---|---|"]
    for block in blocks:
        for warps in warps_list:
            def run(block=block, warps=warps):
                lp, ent = fused_log_probs_and_entropy(logits, targets, temperature=TAU, block_v=block,
                                                      num_warps=warps)
                return torch.autograd.grad([lp, ent], logits, [w, w])[0]
            lines.append(f"| {block} | {warps} | {_median_ms(torch, run, args.repeats):.3f} |")
    return lines


def table(rows: list[dict]) -> list[str]:
    by = {(r["case"], r["masked"], r["method"]): r for r in rows}
    out = ["| case | rows masked | method | fwd+bwd (ms) | vs triton | x floor | extra memory besides grad (MiB) "
           "| no host sync | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = by[(r["case"], r["masked"], "triton")]["ms"]
        out.append(f"| {r['case']} | {r['masked']:.0%} | {r['method']} | {r['ms']:.3f} | {r['ms'] / ref:.2f}x | "
                   f"{r['ms'] / r['floor']:.1f} | {r['mem']:.1f} | {r['sync']} | {r['note']} |".replace("nan", "-"))
    return out


def verdicts(rows: list[dict]) -> list[str]:
    by = {(r["case"], r["masked"], r["method"]): r["ms"] for r in rows}
    out = []
    for (case, masked, method), ms in by.items():
        if method != "triton":
            continue
        v = int(case.split("x")[1])
        if masked == 0:
            limit = 2.0 if v <= 40000 else 8.0 if v <= 160000 else None
            if limit is not None:
                out.append(f"- {case}: triton {ms:.3f} ms, target <= {limit} ms: {'met' if ms <= limit else 'MISSED'}")
            if (case, 0.0, "liger") in by:
                lg = by[(case, 0.0, "liger")]
                out.append(f"- {case}: triton / liger = {ms / lg:.2f} (target <= 1): "
                           f"{'met' if ms <= lg else 'MISSED'}")
        elif (case, 0.0, "triton") in by:
            ratio = ms / by[(case, 0.0, "triton")]
            out.append(f"- {case}, {masked:.0%} rows masked: {ratio:.2f}x of all rows (target <= 0.6): "
                       f"{'met' if ratio <= 0.6 else 'MISSED'}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="16384x32000,16384x32000@0.5,16384x151936,16384x151936@0.5",
                   help="comma-separated TxV[@masked fraction]")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--chunk-size", type=int, default=1024, help="rows per chunk of the torch path")
    p.add_argument("--bandwidth", type=float, default=3350.0, help="HBM GB/s for the floor (H100 SXM: 3350)")
    p.add_argument("--naive", action="store_true", help="accepted for compatibility: the plain row always runs")
    p.add_argument("--sweep", action="store_true", help="also time BLOCK_V x num_warps on the first shape")
    p.add_argument("--write", type=Path, help="replace the table between the bench markers in this markdown file")
    p.add_argument("--label", default="", help="device label for --write (default: torch's device name)")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: run the code paths on tiny shapes (interpreter)")
    p.add_argument("--json", type=Path, help="also write the rows (and the floor of each case) here")
    args = p.parse_args()
    if args.cpu_smoke:
        args.shapes, args.repeats = "8x40,8x40@0.5", 1
    torch = _need_cuda(args.cpu_smoke)
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    import triton

    device = args.label or (torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke run)")
    rows = []
    for t, v, masked in _parse_shapes(args.shapes):
        rows += run_case(torch, args, t, v, masked)
    lines = [f"Device: {device}; torch {torch.__version__}, triton {triton.__version__}; bf16 logits, TP=1, "
             f"temperature {TAU}, forward + backward with entropy; median of {args.repeats}; floor at "
             f"{args.bandwidth:.0f} GB/s.", ""] + table(rows) + [""] + verdicts(rows)
    if args.sweep:
        t, v, _ = _parse_shapes(args.shapes)[0]
        lines += [""] + sweep(torch, args, t, v)
    text = "\n".join(lines)
    print(text)
    if args.json:
        import json

        args.json.write_text(json.dumps({"device": device, "bandwidth_gbs": args.bandwidth, "rows": rows}, indent=2))
    if args.write:
        doc = args.write.read_text()
        if BEGIN not in doc or END not in doc:
            sys.exit(f"{args.write} has no {BEGIN} ... {END} section")
        head, rest = doc.split(BEGIN, 1)
        args.write.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
