"""Benchmark: the Megatron hook's training step against a plain PPO loss on a real bf16 megatron-core GPT.

    python benchmarks/bench_megatron_step.py                       # CUDA: 2048 hidden, 8 layers, 151936 vocab,
                                                                   # 4 micro-batches x 4096 tokens
    python benchmarks/bench_megatron_step.py --json out.json
    python benchmarks/bench_megatron_step.py --device cpu --tiny   # smoke run (megatron's CPU shim), no timing

One process, TP=PP=1: a megatron-core ``GPTModel`` (local layer spec, no Transformer Engine or Apex needed) in
``Float16Module`` (bf16) and megatron DDP, and megatron's own schedule (``get_forward_backward_func()``). One
"step" is one ``forward_backward`` call over ``--micro-batches`` micro-batches (forward + backward, no optimizer),
timed after ``--warmup`` steps as the median of ``--steps`` (CUDA synchronised wall time), with the peak memory
above what the model held before it. Variants:

* ``plain``: the launcher's own loss without the plugin: ``lp = -vocab_parallel_cross_entropy(logits, labels)``
  (megatron's), PPO-clip with ``lp_old = sg(lp)`` (one optimizer step per rollout), token mean over the mask;
  the logits as ``Float16Module`` returns them by default (float32);
* ``hook alg0``: ``tis_forward_backward_func`` with the default configuration (PPO, pi_old from the training
  forward, no extra pass), the launcher's ``forward_step`` unchanged (the hook reads the bf16 logits);
* ``hook alg2``: algorithm 2, token truncate (the TIS weight from the rollout log-probs);
* ``hook alg0 fp32 head`` / ``hook alg0 fused``: ``--tis-fp32-lm-head`` / ``--tis-fused-output-layer``;
* ``hook alg0 triton``: the Triton kernels (``--tis-kernels triton``).

Target: ``hook alg0`` within 5% of ``plain``. Without CUDA (and without ``--device cpu``) it exits 2. A
``KernelFallbackWarning`` is an error here, so the ``triton`` row cannot time the torch code; the script exits 1
when any variant failed (the others still run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _init(device: str) -> None:
    import torch
    import torch.distributed as dist

    if device == "cpu":
        sys.path.insert(0, str(ROOT))
        from examples.rl import cpu_compat

        cpu_compat.patch_runtime(force=True)
        cpu_compat.enable(force=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    if device == "cuda":
        torch.cuda.set_device(0)
    model_parallel_cuda_manual_seed(1234)


def build_model(args, device: str):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.float32,
                            pipeline_dtype=torch.bfloat16, use_cpu_initialization=device == "cpu")
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                   max_sequence_length=args.seq, pre_process=True, post_process=True,
                   share_embeddings_and_output_weights=False)
    if device == "cuda":
        gpt = gpt.cuda()
    model = Float16Module(cfg, gpt)
    ddp = DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False))
    return ddp


def make_items(args, device: str) -> list[dict]:
    import torch

    from slime_tis.megatron import TISBatch

    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(args.micro_batches):
        tokens = torch.randint(0, args.vocab, (1, args.seq), generator=g)
        labels = torch.roll(tokens, -1, 1)
        mask = (torch.arange(args.seq) >= args.seq // 4).float()[None].expand(1, -1).contiguous()  # 1/4 prompt
        adv = torch.randn(1, 1, generator=g).expand(1, args.seq).contiguous()
        rollout = -torch.rand(1, args.seq, generator=g) * 3
        tb = TISBatch.from_padded(labels, mask, adv, rollout).to(device)
        items.append({"tokens": tokens.to(device), "labels": labels.to(device), "mask": mask.to(device),
                      "adv": adv.to(device), "position_ids": torch.arange(args.seq, device=device)[None],
                      "tis": tb})
    return items


def forward_step(data_iterator, model):
    item = next(data_iterator)
    return model(item["tokens"], item["position_ids"], None), None


def plain_forward_step(data_iterator, model):
    """A launcher's PPO loss without the plugin (module docstring)."""
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    item = next(data_iterator)
    logits = model(item["tokens"], item["position_ids"], None)

    def loss_func(output):
        lp = -vocab_parallel_cross_entropy(output.float(), item["labels"])
        ratio = torch.exp(lp - lp.detach())
        adv = item["adv"]
        per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        loss = (per_tok * item["mask"]).sum() / item["mask"].sum().clamp(min=1)
        return loss, {"loss": loss.detach()}

    return logits, loss_func


def variants(args) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from slime_tis import TISConfig
    from slime_tis.megatron import tis_forward_backward_func

    fbf = get_forward_backward_func()

    def hook(cfg, **kw):
        return tis_forward_backward_func(fbf, cfg, temperature=1.0, chunk_size=args.chunk_size, **kw), forward_step

    out = {"plain": (fbf, plain_forward_step),
           "hook alg0": hook(TISConfig()),
           "hook alg2": hook(TISConfig(use_tis=True, mode="truncate", level="token")),
           "hook alg0 fp32 head": hook(TISConfig(), fp32_lm_head=True),
           "hook alg0 fused": hook(TISConfig(), fused_output_layer=True)}
    out["hook alg0 triton"] = hook(TISConfig(kernels="triton"))
    return out


def time_variant(args, device: str, ddp, items, fb, step_fn) -> dict:
    import torch

    def step():
        ddp.zero_grad_buffer()
        fb(forward_step_func=step_fn, data_iterator=iter(items), model=[ddp], num_microbatches=len(items),
           seq_length=args.seq, micro_batch_size=1, forward_only=False)
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = float("nan")
    if device == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return {"ms": statistics.median(times), "peak_extra_gib": peak}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (smoke run)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=4096, help="rows per chunk of the torch log-prob path")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only", default=None, help="comma-separated variant names")
    p.add_argument("--target", type=float, default=1.05, help="hook alg0 / plain must be at most this")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_megatron_step.py: CUDA is not available; nothing measured (--device cpu --tiny: smoke run)")
        return 2
    if args.tiny:
        args.hidden, args.layers, args.heads, args.vocab, args.seq = 32, 2, 4, 64, 16
        args.micro_batches, args.warmup, args.steps = 2, 1, 1
    sys.path.insert(0, str(ROOT))
    import warnings

    from slime_tis.kernels.dispatch import KernelFallbackWarning

    warnings.simplefilter("error", KernelFallbackWarning)  # the "triton" row must time the kernels, not torch
    _init(args.device)
    ddp = build_model(args, args.device)
    items = make_items(args, args.device)
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)",
               "shape": {k: v for k, v in vars(args).items() if k != "json"}, "variants": {}}
    wanted = None if args.only is None else set(args.only.split(","))
    for name, v in variants(args).items():
        if wanted is not None and name not in wanted:
            continue
        try:
            results["variants"][name] = time_variant(args, args.device, ddp, items, *v)
        except Exception as exc:  # out of memory, a kernel that cannot run: noted, the others still run
            results["variants"][name] = {"note": f"failed: {exc!r}"[:300], "error": traceback.format_exc()}
        if args.device == "cuda":
            torch.cuda.empty_cache()
    base = results["variants"].get("plain", {}).get("ms")
    print(f"# {results['device']}: GPT hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"{args.micro_batches} micro-batches x {args.seq} tokens, bf16 (Float16Module), TP=PP=1")
    print("| variant | step ms | vs plain | peak extra GiB | note |")
    print("|---|---|---|---|---|")
    for name, r in results["variants"].items():
        if "ms" in r:
            ratio = f"{r['ms'] / base:.3f}x" if base else "-"
            print(f"| {name} | {r['ms']:.1f} | {ratio} | {r['peak_extra_gib']:.2f} | |")
        else:
            print(f"| {name} | - | - | - | {r['note']} |")
    hook = results["variants"].get("hook alg0", {}).get("ms")
    if base and hook:
        results["overhead_alg0"] = hook / base - 1
        verdict = "met" if hook / base <= args.target else "MISSED"
        print(f"hook alg0 / plain = {hook / base:.3f} (target <= {args.target}): {verdict}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    failed = [n for n, r in results["variants"].items() if "error" in r]
    if failed:
        print(f"FAILED variants (a kernel fallback is a failure): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
