"""Benchmark (CUDA): the fused Triton log-prob + entropy kernels vs the chunked torch path and Liger-Kernel.

    python benchmarks/bench_logprobs_kernel.py                       # the issue's cases, one table
    python benchmarks/bench_logprobs_kernel.py --write docs/kernels.md --label "H100 SXM"
    python benchmarks/bench_logprobs_kernel.py --sweep               # also time block sizes x warps
    python benchmarks/bench_logprobs_kernel.py --cpu-smoke           # no GPU: tiny shapes, interpreter, no timing

Work per case: ``T`` tokens x ``V`` vocabulary, bfloat16 logits, TP=1, temperature 0.7, forward + backward
with entropy (upstream gradients random for both outputs). Methods:

* ``triton``: ``vocab_parallel_log_probs_and_entropy(..., kernels="triton", row_mask=...)`` (this package);
* ``torch``: the same function with ``kernels="torch"`` (chunked, ``--chunk-size`` rows; the reference);
* ``liger``: Liger-Kernel's ``LigerCrossEntropyLoss(reduction="sum")`` on the same logits (log-probs only,
  no entropy, no temperature; masked rows as ``ignore_index``). Skipped with a note when ``liger-kernel`` is
  not installed. It writes the gradient over the logits in its forward and syncs the host (``.item()``);
* ``naive``: ``log_softmax(z.float() / tau)`` + ``gather`` + entropy with autograd (``--naive``).

Reported: median CUDA-event time of ``--repeats`` runs after a warm-up; ``x floor``: that time over the
bandwidth floor (bytes read and written by one forward read, one backward read and one gradient write of
the active rows, the gradient write of all rows, at ``--bandwidth`` GB/s); peak extra memory besides the
logits gradient (``max_memory_allocated`` during one run minus the allocation before it, minus ``T x V``
gradient bytes where the method allocates one); whether forward + backward ran under
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
    fn()
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():  # --cpu-smoke
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _peak_extra_mib(torch, fn, grad_bytes: int) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base - grad_bytes) / 2**20


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


def _methods(torch, args, logits, targets, keep, w_lp, w_h):
    """name -> (callable running forward + backward, allocates a [T, V] gradient?)."""
    from slime_tis.megatron.logprobs import vocab_parallel_log_probs_and_entropy as lp_and_h

    mask = None if bool(keep.all()) else keep  # host read here, outside every timed region

    def ours(kernels: str):
        def run():
            lp, ent = lp_and_h(logits, targets, temperature=TAU, tp_group=None, row_mask=mask, kernels=kernels,
                               chunk_size=args.chunk_size)
            return torch.autograd.grad([lp, ent], logits, [w_lp, w_h])[0]
        return run

    methods = {"triton": (ours("triton"), True), "torch": (ours("torch"), True)}
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except ImportError:
        LigerCrossEntropyLoss = None
    if LigerCrossEntropyLoss is not None:
        liger_loss = LigerCrossEntropyLoss(reduction="sum")
        liger_in = logits.detach().clone().requires_grad_(True)  # overwritten by its gradient on every call
        liger_targets = torch.where(keep, targets, -100)

        def liger():
            loss = liger_loss(liger_in, liger_targets)
            return torch.autograd.grad(loss, liger_in)[0]
        methods["liger"] = (liger, False)
    if args.naive:
        def naive():
            lsm = torch.log_softmax(logits.float() / TAU, dim=-1)
            lp = lsm.gather(-1, targets[:, None]).squeeze(-1)
            ent = -(lsm.exp() * lsm).sum(-1)
            return torch.autograd.grad([lp, ent], logits, [w_lp * keep, w_h * keep])[0]
        methods["naive"] = (naive, True)
    return methods


def _check(torch, logits, targets, keep) -> str:
    """triton vs torch on this case: max |d lp|, |d H| (float32), max |d grad| / max |grad| (bf16 grads)."""
    from slime_tis.megatron.logprobs import vocab_parallel_log_probs_and_entropy as lp_and_h

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
    for name, (fn, allocates_grad) in methods.items():
        try:
            ms = _median_ms(torch, fn, args.repeats)
            mem = _peak_extra_mib(torch, fn, grad_bytes if allocates_grad else 0)
        except Exception as err:  # out of memory (naive), or a third-party kernel failing: noted, not fatal
            if name in ("triton", "torch"):
                raise
            torch.cuda.empty_cache()
            why = "out of memory" if isinstance(err, torch.OutOfMemoryError) else f"failed: {err!r}"[:80]
            rows.append(dict(case=f"{t}x{v}", masked=masked, method=name, ms=float("nan"), mem=float("nan"),
                             floor=floor_ms, sync="-", note=why))
            continue
        sync = _sync_free(torch, fn) if name in ("triton", "torch") else "no (.item())" if name == "liger" else "-"
        rows.append(dict(case=f"{t}x{v}", masked=masked, method=name, ms=ms, mem=mem, floor=floor_ms, sync=sync,
                         note=note if name == "triton" else ""))
    del logits
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
                   f"{r['ms'] / r['floor']:.1f} | {r['mem']:.1f} | {r['sync']} | {r['note']} |")
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
    p.add_argument("--naive", action="store_true", help="also time log_softmax + gather (needs ~5 x T x V x 4 B)")
    p.add_argument("--sweep", action="store_true", help="also time BLOCK_V x num_warps on the first shape")
    p.add_argument("--write", type=Path, help="replace the table between the bench markers in this markdown file")
    p.add_argument("--label", default="", help="device label for --write (default: torch's device name)")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: run the code paths on tiny shapes (interpreter)")
    p.add_argument("--json", type=Path, help="also write the rows (and the floor of each case) here")
    args = p.parse_args()
    if args.cpu_smoke:
        args.shapes, args.repeats = "8x40,8x40@0.5", 1
    torch = _need_cuda(args.cpu_smoke)
    sys.path.insert(0, str(ROOT))
    import triton

    device = args.label or (torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke run)")
    rows = []
    for t, v, masked in _parse_shapes(args.shapes):
        rows += run_case(torch, args, t, v, masked)
    has_liger = any(r["method"] == "liger" for r in rows)
    lines = [f"Device: {device}; torch {torch.__version__}, triton {triton.__version__}; bf16 logits, TP=1, "
             f"temperature {TAU}, forward + backward with entropy; median of {args.repeats}; floor at "
             f"{args.bandwidth:.0f} GB/s.", ""] + table(rows) + [""] + verdicts(rows)
    if not has_liger:
        lines.append("- liger: column skipped, `liger-kernel` is not installed (`pip install liger-kernel`).")
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
