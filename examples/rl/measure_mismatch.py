"""Paired mismatch measurement: every engine variant samples the same rollout batches from the same weights.

    python -m examples.rl.measure_mismatch --run-dir runs/alg2            # latest checkpoint of a run
    python -m examples.rl.measure_mismatch --run-dir runs/alg2 --step 0   # the initial weights (no checkpoint)

The weights come from the run's dist checkpoint (or the seeded initialisation with ``--step 0``); the trainer's
policy is the float32 full-sequence model (the megatron model and the float32 decoder agree to 1e-5 in the
logits, ``tests/test_example_rl.py``). For each engine variant (``VARIANTS``) and each of ``--batches`` rollout
batches (the run's prompts and sampling seeds of steps 0, 1, ...), the engine samples and reports its log-probs,
and per response token ``log r = log pi_train - log pi_engine``. Printed per variant (as the hook's metrics):
``tis/k3_kl`` = mean over tokens of ``r - 1 - log r``, ``tis/ratio_min`` / ``tis/ratio_max``, and the
fraction of tokens with ``r`` outside [0.5, 2] (what IcePop-style token masking would drop).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

#: engine variant -> EmbeddedEngine keyword arguments
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": torch.float32},
    "bf16": {"dtype": torch.bfloat16},
    "bf16-head32": {"dtype": torch.bfloat16, "lm_head_fp32": True},
    "int8": {"dtype": torch.bfloat16, "quant": "int8"},
    "int8-head32": {"dtype": torch.bfloat16, "quant": "int8", "lm_head_fp32": True},
    "fp8": {"dtype": torch.bfloat16, "quant": "fp8"},
    "fp8-tensor": {"dtype": torch.bfloat16, "quant": "fp8-tensor"},
}


def token_log_ratios(reference: Any, batch: Any, temperature: float) -> torch.Tensor:
    """``log pi_train - log pi_rollout`` on the response tokens of ``batch`` (1-D, float32)."""
    logits, _ = reference.forward(batch.tokens, 0, None)
    lp = torch.log_softmax(logits / temperature, -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    return (lp - batch.rollout_log_probs)[batch.loss_mask]


def summarize(log_r: torch.Tensor) -> dict[str, float]:
    """The hook's mismatch metrics of a set of token log-ratios (see module docstring)."""
    r = log_r.double().exp()
    return {
        "tis/k3_kl": float((r - 1 - log_r.double()).mean()),
        "tis/ratio_min": float(r.min()),
        "tis/ratio_max": float(r.max()),
        "outside [0.5, 2]": float(((r < 0.5) | (r > 2)).double().mean()),
        "tokens": float(log_r.numel()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.rl.measure_mismatch", description=__doc__)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest; 0 = initial weights)")
    p.add_argument("--batches", type=int, default=4, help="rollout batches per variant")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args(argv)
    with open(os.path.join(args.run_dir, "args.json"), encoding="utf-8") as f:
        run = json.load(f)

    from examples.rl import checkpoint
    from examples.rl.dist import init_distributed, shutdown
    from examples.rl.model import KVCacheGPT, ModelConfig, build_megatron_gpt, gather_gpt2_weights
    from examples.rl.rollout import RolloutSettings, collect_rollout
    from examples.rl.rollout_engine import EmbeddedEngine
    from examples.rl.task import DigitTask

    init_distributed(pp=1, seed=run["seed"])
    try:
        task = DigitTask(num_digits=run["num_digits"], transform=run["transform"])
        cfg = ModelConfig(
            num_layers=run["num_layers"],
            hidden_size=run["hidden_size"],
            num_heads=run["num_heads"],
            max_seq_len=max(16, task.max_seq_len),
        )
        torch.manual_seed(run["seed"])
        model = build_megatron_gpt(cfg)
        step = checkpoint.latest_step(args.run_dir) if args.step is None else args.step
        if step:
            checkpoint.load_model(args.run_dir, step, model)
        weights = gather_gpt2_weights(model, cfg)
        reference = KVCacheGPT(cfg, weights, dtype=torch.float32)
        settings = RolloutSettings(
            run["prompts_per_step"],
            run["group_size"],
            run["rollout_temperature"],
            run["rollout_top_p"],
            run["rollout_top_k"],
            run["seed"],
        )
        print(f"run {args.run_dir}, weights after step {step or 0}, {args.batches} batches per variant")
        print("| engine | tis/k3_kl | tis/ratio_min | tis/ratio_max | tokens outside [0.5, 2] | tokens |")
        print("|---|---|---|---|---|---|")
        for name in args.variants:
            engine = EmbeddedEngine(cfg, **VARIANTS[name])
            engine.load_weights(weights)
            log_r = torch.cat(
                [
                    token_log_ratios(reference, collect_rollout(engine, task, settings, b), settings.temperature)
                    for b in range(args.batches)
                ]
            )
            m = summarize(log_r)
            print(
                f"| {name} | {m['tis/k3_kl']:.2e} | {m['tis/ratio_min']:.4f} | {m['tis/ratio_max']:.4f} | "
                f"{m['outside [0.5, 2]']:.2e} | {m['tokens']:.0f} |",
                flush=True,
            )
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
