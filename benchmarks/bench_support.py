"""Benchmark: the sampling-support replay of the log-prob pass against the full-vocabulary pass.

    python benchmarks/bench_support.py                            # 16384 x 152064 on CUDA, 1024 x 152064 on the CPU
    python benchmarks/bench_support.py --tokens 2048 --vocab 32768

Both are ``slime_tis.engine.logprobs.vocab_parallel_log_probs_and_entropy`` at TP=1 (log-probs and entropy),
without ``support`` (``full``: the chunked log-softmax over the vocabulary) and with a CSR support of ``k`` ids
per token (``replay k``: the target plus ``k - 1`` distinct random ids), for ``k`` in ``--support``. Modes:
``fwd`` and ``fwd+bwd`` (plus the gradient of ``sum(lp) + sum(H)`` with respect to the logits, whose
``[T, V]`` buffer both must allocate), with each of ``--kernels`` (``torch``; on CUDA also ``triton``, the Triton
kernels, a fallback to torch then an error). Each measurement runs in a fresh process: time is the best of
``--repeats`` runs after one warm-up; "peak extra" is the high-water mark above the inputs (logits
``[T, V]``, targets, support): ``torch.cuda.max_memory_allocated`` on CUDA, ``ru_maxrss`` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _support(targets, k: int, vocab: int, gen):
    """``k`` distinct ids per row, the target among them: ``(ids [T k] int32, offsets [T + 1] int64)``."""
    import torch

    n = targets.numel()
    dev = targets.device
    offsets = torch.arange(n + 1, dtype=torch.int64, device=dev) * k
    if k == 1:
        return targets.to(torch.int32), offsets
    others = torch.randperm(vocab - 1, generator=gen)[: k - 1].to(dev)          # distinct in [0, V - 1)
    shift = torch.randint(0, vocab - 1, (n, 1), generator=gen).to(dev)
    ids = (targets[:, None] + 1 + (others[None, :] + shift) % (vocab - 1)) % vocab  # distinct, never the target
    ids = torch.cat([targets[:, None], ids], dim=1)
    return ids.reshape(-1).to(torch.int32), offsets


def _one(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    logits = torch.empty(args.tokens, args.vocab, device=dev, dtype=getattr(torch, args.dtype))
    for start in range(0, args.tokens, 64):  # in pieces: no [T, V] float32 temporary in the high-water mark
        rows = logits[start:start + 64]
        rows.copy_(torch.randn(rows.shape, generator=gen) * 2)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(dev)
    support = None if args.k == 0 else _support(targets, args.k, args.vocab, gen)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_mb()

    if args.kernels == "triton":
        import warnings

        from slime_tis.kernels.dispatch import KernelFallbackWarning

        warnings.simplefilter("error", KernelFallbackWarning)

    def run():
        z = logits.requires_grad_(args.mode == "fwd+bwd")
        lp, ent = vocab_parallel_log_probs_and_entropy(z, targets, tp_group=None, support=support,
                                                       kernels=args.kernels)
        if args.mode == "fwd+bwd":
            (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), z)
            del grad
        if cuda:
            torch.cuda.synchronize()

    run()
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    if cuda:
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return {"k": args.k, "mode": args.mode, "kernels": args.kernels, "ms": best * 1e3, "peak_extra_mb": extra}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None, help="T (default 16384 on CUDA, 1024 on the CPU)")
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--support", type=int, nargs="+", default=[1, 64, 1024])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", nargs="+", default=None, choices=("torch", "triton"),
                   help="default: torch on the CPU, torch and triton on CUDA")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="fwd", help=argparse.SUPPRESS)
    p.add_argument("--kernel", default="torch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tokens is None:
        args.tokens = 16384 if args.device == "cuda" else 1024
    if args.kernels is None:
        args.kernels = ["torch", "triton"] if args.device == "cuda" else ["torch"]
    if args.one:
        args.kernels = args.kernel
        print(json.dumps(_one(args)))
        return 0
    print(f"T = {args.tokens}, V = {args.vocab}, logits {args.dtype} on {args.device}, TP = 1, "
          f"best of {args.repeats}")
    print("| pass | kernels | mode | time (ms) | peak extra (MiB) |")
    print("|---|---|---|---|---|")
    cases = [(mode, kernel, k) for mode in ("fwd", "fwd+bwd") for kernel in args.kernels for k in [0, *args.support]]
    for mode, kernel, k in cases:
        cmd = [sys.executable, __file__, "--one", "--k", str(k), "--mode", mode, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--dtype", args.dtype, "--device", args.device,
               "--repeats", str(args.repeats), "--threads", str(args.threads), "--kernel", kernel]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        name = "full" if k == 0 else f"replay {k}"
        print(f"| {name} | {kernel} | {mode} | {r['ms']:.1f} | {r['peak_extra_mb']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
