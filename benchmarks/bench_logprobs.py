"""Benchmark: chunked vocab-parallel log-probs + entropy vs the naive ``log_softmax(logits).gather(...)``.

    python benchmarks/bench_logprobs.py                 # 8192 tokens x 32k vocabulary, TP=1 and TP=2
    python benchmarks/bench_logprobs.py --tokens 2048   # smaller

Each measurement runs in a fresh process (TP=2: ``torchrun --nproc-per-node 2``, gloo), so the peak
resident-set size (``ru_maxrss``) is that measurement's own high-water mark. "Peak extra memory" is
``maxrss`` after the computation minus the RSS once the inputs exist (logits ``[T, V/TP]`` float32, labels),
i.e. everything the method allocates, outputs and autograd state included. Time is the best of
``--repeats`` runs after one warm-up. Methods:

* ``naive``: ``lp = log_softmax(z / tau).gather(labels)``, ``H = -(exp(lsm) * lsm).sum(-1)`` on the full
  vocabulary (TP=2: the logits are all-gathered over TP first, as a non-vocab-parallel loss would);
* ``megatron_ce`` (TP=2 only): megatron-core's ``vocab_parallel_cross_entropy`` (log-probs only, no entropy);
* ``chunked``: ``slime_tis.megatron.vocab_parallel_log_probs_and_entropy`` (``--chunk-size`` rows at a time).

Modes: ``fwd`` (log-probs and entropy) and ``fwd+bwd`` (plus the gradient of ``sum(lp) + sum(H)`` with
respect to the logits, whose ``[T, V/TP]`` buffer every method must allocate).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one(args: argparse.Namespace) -> dict:
    """One measurement in this process (rank of a TP group when launched by torchrun)."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy

    torch.set_num_threads(args.threads)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    rank = 0
    if tp > 1:
        dist.init_process_group("gloo")
        group, rank = dist.group.WORLD, dist.get_rank()
    vp = args.vocab // tp
    g = torch.Generator().manual_seed(rank)
    # generated in place: no temporary of the same size may raise ru_maxrss before the baseline
    logits = torch.randn(args.tokens, vp, generator=g).mul_(2).requires_grad_(args.mode == "fwd+bwd")
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(0))
    tau = 0.7

    def naive():
        z = logits
        if tp > 1:
            z = dist_fn.all_gather(z, group=group)
            z = torch.cat(z, dim=-1)
        lsm = torch.log_softmax(z.float() / tau, dim=-1)
        lp = lsm.gather(-1, labels[:, None]).squeeze(-1)
        ent = -(lsm.exp() * lsm).sum(-1)
        return lp, ent

    def megatron_ce():
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        lp = -vocab_parallel_cross_entropy((logits / tau)[None], labels[None])[0]
        return lp, None

    def chunked():
        return vocab_parallel_log_probs_and_entropy(logits, labels, temperature=tau, chunk_size=args.chunk_size,
                                                    tp_group=group)

    fn = {"naive": naive, "chunked": chunked, "megatron_ce": megatron_ce}[args.method]

    def run():
        lp, ent = fn()
        if args.mode == "fwd+bwd":
            total = lp.sum() + (ent.sum() if ent is not None else 0.0)
            (grad,) = torch.autograd.grad(total, logits)
            return lp, ent, grad
        return lp, ent

    if args.method == "megatron_ce":  # initialise its process groups outside the measured region
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    base = _rss_mb()
    if _maxrss_mb() > base + 16:
        raise RuntimeError(f"high-water mark {_maxrss_mb():.0f} MiB above the baseline RSS {base:.0f} MiB")
    out = run()  # first run: memory high-water mark and warm-up
    peak = _maxrss_mb() - base
    lp_first = out[0].detach().clone()
    del out
    times = []
    for _ in range(args.repeats):
        if tp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        del out
    res = {"method": args.method, "mode": args.mode, "tp": tp, "rank": rank, "tokens": args.tokens,
           "vocab": args.vocab, "chunk_size": args.chunk_size, "seconds": min(times), "peak_extra_mb": peak,
           "inputs_mb": logits.numel() * 4 / 2**20, "lp_checksum": float(lp_first.double().sum())}
    if tp > 1:
        gathered = [None] * tp
        dist.all_gather_object(gathered, res)
        dist.destroy_process_group()
        if rank != 0:
            return {}
        res = dict(gathered[0], seconds=max(r["seconds"] for r in gathered),
                   peak_extra_mb=max(r["peak_extra_mb"] for r in gathered))
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(method: str, mode: str, tp: int, args: argparse.Namespace) -> dict:
    one = [__file__, "--one", "--method", method, "--mode", mode, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats),
           "--threads", str(args.threads)]
    if tp == 1:
        cmd = [sys.executable, *one]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), *one]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} {mode} tp={tp} failed:\n{proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="chunked", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="fwd", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        res = _one(args)
        if res:
            print(json.dumps(res), flush=True)
        return
    rows = []
    print(f"log-probs + entropy of {args.tokens} tokens over a {args.vocab} vocabulary, float32 logits, "
          f"temperature 0.7, chunk_size={args.chunk_size}, {args.threads} thread(s)/process, best of {args.repeats}")
    print("| TP | mode | method | time (s) | peak extra memory (MiB) | time vs naive | memory vs naive |")
    print("|---|---|---|---|---|---|---|")
    for tp in (int(t) for t in args.tp.split(",")):
        for mode in args.modes.split(","):
            methods = ["naive", "chunked"] + (["megatron_ce"] if tp > 1 and mode == "fwd" else [])
            res = {m: _spawn(m, mode, tp, args) for m in methods}
            for m in methods:
                r = res[m]
                print(f"| {tp} | {mode} | {m} | {r['seconds']:.3f} | {r['peak_extra_mb']:.0f} | "
                      f"{r['seconds'] / res['naive']['seconds']:.2f}x | "
                      f"{r['peak_extra_mb'] / max(res['naive']['peak_extra_mb'], 1e-9):.3f} |", flush=True)
                rows.append(r)
            assert abs(res["chunked"]["lp_checksum"] - res["naive"]["lp_checksum"]) < 1e-2 * args.tokens ** 0.5, \
                "chunked and naive log-probs disagree"
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
