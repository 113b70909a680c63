"""GPU check of the megatron loss hook: overhead on a 1M-token packed batch and no host sync in the loss path.

    python benchmarks/gpu_check_megatron.py                       # CUDA: 1M tokens, 32k vocabulary
    python benchmarks/gpu_check_megatron.py --device cpu --tokens 8192 --micro-tokens 2048   # smoke run

Without CUDA (and without ``--device cpu``) it prints why and exits 0.

The 1M-token global batch (``--tokens``, sequences of ``--seq-len``) is processed as megatron would, in
micro-batches of ``--micro-tokens`` tokens with logits ``[micro_tokens, vocab]`` (bf16 on CUDA): per
micro-batch ``loss_func(logits)`` then ``backward``. Compared, per micro-batch and in total:

* ``plain_ppo``: ``log_softmax(logits.float() / tau).gather`` + the PPO-clip token-mean loss (what a
  launcher without the plugin computes);
* ``hook alg k``: the hook's ``make_loss_func`` (chunked vocab log-probs + entropy, the core
  ``policy_loss`` of algorithm k with its diagnostics) with the step plan computed once beforehand.

On CUDA the hook's loss path (``loss_func`` and ``backward``) runs under
``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation raises and is reported. Peak GPU
memory of each path is printed too; ``--json`` writes the rows. Exit 1 when a hook path hit a host sync.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_tis import TISConfig  # noqa: E402
from slime_tis.core import LocalReducer  # noqa: E402
from slime_tis.megatron import LossForm, TISBatch, make_loss_func, step_totals  # noqa: E402

CONFIGS = {
    "alg0 (PPO)": TISConfig(),
    "alg2 token truncate": TISConfig(use_tis=True, mode="truncate", level="token"),
    "alg2 sequence mask + bn": TISConfig(use_tis=True, mode="mask", level="sequence", upper=5.0,
                                         batch_normalize=True),
    "alg3 geometric mask + veto": TISConfig(use_rollout_log_probs=True, use_tis=True, mode="mask",
                                            level="geometric", upper=1.05, veto_threshold=1e-4),
}
TAU = 0.8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _microbatch(k: int, n_tok: int, seq_len: int, vocab: int, device: torch.device, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(k)
    labels = torch.randint(0, vocab, (n_tok,), generator=g)
    mask = (torch.rand(n_tok, generator=g) < 0.9)
    adv = torch.randn(n_tok // seq_len, generator=g).repeat_interleave(seq_len)
    lp_old = -torch.rand(n_tok, generator=g) * 3
    rollout = lp_old + 0.05 * torch.randn(n_tok, generator=g)
    cu = torch.arange(0, n_tok + 1, seq_len)
    tb = TISBatch(labels=labels, loss_mask=mask, advantages=adv, cu_seqlens=cu, rollout_log_probs=rollout)
    tb.old_log_probs = lp_old
    return tb.to(device)


def plain_ppo_loss(logits: torch.Tensor, tb: TISBatch, n_total: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.float() / TAU, -1).gather(-1, tb.labels[:, None]).squeeze(-1)
    ratio = torch.exp(lp - tb.old_log_probs)
    adv = tb.advantages
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    return torch.where(tb.loss_mask, per_tok, torch.zeros_like(per_tok)).sum() / n_total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--micro-tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check_megatron: CUDA is not available on this machine; skipping (exit 0).")
        return 0
    if args.tokens % args.micro_tokens or args.micro_tokens % args.seq_len:
        p.error("--tokens must be a multiple of --micro-tokens, which must be a multiple of --seq-len")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m = args.tokens // args.micro_tokens
    print(f"device={device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}; {args.tokens} tokens = {m} micro-batches x {args.micro_tokens} tokens, "
          f"vocab {args.vocab}, logits {dtype}, seq_len {args.seq_len}, chunk_size {args.chunk_size}")
    batches = [_microbatch(k, args.micro_tokens, args.seq_len, args.vocab, device, dtype) for k in range(m)]
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.micro_tokens, args.vocab, generator=g, device=device) * 2).to(dtype)
    logits.requires_grad_(True)
    n_total = torch.stack([b.loss_mask.sum() for b in batches]).sum().float()

    def run(step) -> tuple[float, float]:
        for k in range(min(2, m)):  # warm-up
            step(k)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        t0 = time.perf_counter()
        for k in range(m):
            step(k)
        _sync(device)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
        return time.perf_counter() - t0, peak

    def plain_step(k):
        logits.grad = None
        plain_ppo_loss(logits, batches[k], n_total).backward()

    t_plain, mem_plain = run(plain_step)
    rows = {"plain_ppo": {"s": t_plain, "peak_extra_mib": mem_plain, "host_sync": "n/a"}}
    print("| path | total (s) | per micro-batch (ms) | vs plain | peak extra GPU MiB | host sync in loss |")
    print("|---|---|---|---|---|---|")
    print(f"| plain_ppo | {t_plain:.3f} | {1e3 * t_plain / m:.2f} | 1.00x | {mem_plain:.0f} | n/a |")
    form = LossForm(per_token=False, num_microbatches=m, cp_size=1, grad_average=1)
    for name, cfg in CONFIGS.items():
        plan = step_totals(cfg, batches, LocalReducer(),
                         pre_log_probs=[b.old_log_probs for b in batches] if cfg.algorithm in (1, 3) else None)
        collector: list = []
        sync_error = "none"

        def hook_step(k, cfg=cfg, plan=plan, collector=collector):
            logits.grad = None
            fn = make_loss_func(cfg, batches[k], plan, form, LocalReducer(), collector=collector,
                                temperature=TAU, chunk_size=args.chunk_size)
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                loss, _ = fn(logits)
                loss.backward()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")

        try:
            t_hook, mem_hook = run(hook_step)
        except RuntimeError as exc:  # a host sync under set_sync_debug_mode("error")
            sync_error = str(exc).splitlines()[0]
            print(f"| hook {name} | - | - | - | - | {sync_error} |")
            rows[f"hook {name}"] = {"note": sync_error, "host_sync": sync_error}
            continue
        rows[f"hook {name}"] = {"s": t_hook, "peak_extra_mib": mem_hook,
                                "host_sync": sync_error if device.type == "cuda" else "not checked (cpu)"}
        print(f"| hook {name} | {t_hook:.3f} | {1e3 * t_hook / m:.2f} | {t_hook / t_plain:.2f}x | {mem_hook:.0f} "
              f"| {sync_error if device.type == 'cuda' else 'not checked (cpu)'} |")
    if args.json:
        import json

        args.json.write_text(json.dumps({"device": str(device), "tokens": args.tokens, "micro_batches": m,
                                         "rows": rows}, indent=2))
    failed = [n for n, r in rows.items() if "note" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
