"""Top-p / top-k rollouts: the token ratio with the trainer's log-probs over the full vocabulary (``full``) and
over the support each token was sampled from (``replay``).

    python -m examples.rl.measure_support                      # top-p 0.9 and top-k 20, 4 batches each

The engine (the example's SGLang-protocol engine, bfloat16 by default) samples as SGLang does (temperature, then
top-k, then top-p) and returns, as SGLang's ``return_sampling_mask``, each token's support and its log-prob under
the truncated distribution it was drawn from: pi_rollout. The trainer's policy is the float32 full-sequence
model of the same weights (the megatron model and it agree to 1e-5 in the logits, ``tests/test_example_rl.py``);
its log-probs come from the plugin's ``vocab_parallel_log_probs_and_entropy``, without and with
``support=`` (the batch's CSR). Per response token ``r = pi_train(y) / pi_rollout(y)``, and the kept mass
``S = exp(lp_full - lp_replay)`` (the trainer's probability of the support).

Printed per sampling setting and mode: the mean ratio with its standard error, the mean kept mass, the fraction of
tokens with ``r`` outside [0.9, 1.1], and the checks: ``full``: |mean r - mean S| within 2 standard errors of
their per-token difference (the ratio is the kept mass, token by token, up to the engine's rounding);
``replay``: |mean r - 1| < 0.5 % and the fraction outside [0.9, 1.1] at least 5x smaller than with ``full``.
Exit status 1 when a check fails.

The weights are the seeded initialisation with the final layer norm's scale multiplied by ``--logit-scale``
(an untrained model predicts a near-uniform distribution, for which top-p keeps almost everything; the scale
makes the distributions peaked as a trained model's are).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

SETTINGS = {"top-p 0.9": {"top_p": 0.9, "top_k": -1}, "top-k 20": {"top_p": 1.0, "top_k": 20}}


def token_stats(reference: Any, batch: Any, temperature: float) -> dict[str, torch.Tensor]:
    """Per response token of ``batch`` (rejected sequences excluded): ``log r`` under both modes and ``log S``."""
    from examples.rl.batch import support_csr
    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy

    logits, _ = reference.forward(batch.tokens, 0, None)
    flat = logits.reshape(-1, logits.shape[-1])
    labels, mask = batch.labels.reshape(-1), batch.loss_mask.reshape(-1)
    full, _ = vocab_parallel_log_probs_and_entropy(flat, labels, temperature=temperature, tp_group=None,
                                                   row_mask=mask, with_entropy=False)
    replay, _ = vocab_parallel_log_probs_and_entropy(flat, labels, temperature=temperature, tp_group=None,
                                                     row_mask=mask, with_entropy=False, support=support_csr(batch))
    ok = mask & (batch.sglang_rejected[:, None].expand_as(batch.loss_mask).reshape(-1) == 0)
    rollout = batch.rollout_log_probs.reshape(-1)
    return {"full": (full - rollout)[ok], "replay": (replay - rollout)[ok], "log_mass": (full - replay)[ok]}


def summarize(log_r: torch.Tensor, log_mass: torch.Tensor) -> dict[str, float]:
    r, s = log_r.double().exp(), log_mass.double().exp()
    n = r.numel()
    return {
        "mean_ratio": float(r.mean()),
        "se_ratio": float(r.std() / math.sqrt(n)),
        "mean_mass": float(s.mean()),
        "se_diff": float((r - s).std() / math.sqrt(n)),
        "outside": float(((r < 0.9) | (r > 1.1)).double().mean()),
        "tokens": float(n),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.rl.measure_support", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=4, help="rollout batches per setting")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=64, help="the model's vocabulary (> 20 for top-k 20 to cut)")
    p.add_argument("--logit-scale", type=float, default=8.0, help="final layer norm scale factor (docstring)")
    p.add_argument("--engine-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = p.parse_args(argv)

    from examples.rl.dist import init_distributed, shutdown
    from examples.rl.model import KVCacheGPT, ModelConfig, build_megatron_gpt, gather_gpt2_weights
    from examples.rl.rollout import RolloutSettings, collect_rollout
    from examples.rl.rollout_engine import EmbeddedEngine
    from examples.rl.task import DigitTask

    init_distributed(pp=1, seed=args.seed)
    failed = 0
    try:
        task = DigitTask()
        cfg = ModelConfig(vocab_size=args.vocab_size, max_seq_len=max(16, task.max_seq_len))
        torch.manual_seed(args.seed)
        weights = gather_gpt2_weights(build_megatron_gpt(cfg), cfg)
        weights["transformer.ln_f.weight"] = weights["transformer.ln_f.weight"] * args.logit_scale
        reference = KVCacheGPT(cfg, weights, dtype=torch.float32)
        engine = EmbeddedEngine(cfg, dtype=getattr(torch, args.engine_dtype))
        engine.load_weights(weights)
        print(f"vocabulary {cfg.vocab_size}, engine {args.engine_dtype}, trainer float32, temperature "
              f"{args.temperature}, {args.batches} batches of {args.prompts_per_step * args.group_size} responses")
        print("| sampling | mode | mean ratio (± s.e.) | mean kept mass | tokens outside [0.9, 1.1] | tokens |")
        print("|---|---|---|---|---|---|")
        for name in args.settings:
            s = RolloutSettings(args.prompts_per_step, args.group_size, args.temperature, seed=args.seed,
                                support_vocab_size=cfg.vocab_size, **SETTINGS[name])
            parts = [token_stats(reference, collect_rollout(engine, task, s, b), s.temperature)
                     for b in range(args.batches)]
            stats = {k: torch.cat([q[k] for q in parts]) for k in parts[0]}
            m = {mode: summarize(stats[mode], stats["log_mass"]) for mode in ("full", "replay")}
            for mode in ("full", "replay"):
                x = m[mode]
                print(f"| {name} | {mode} | {x['mean_ratio']:.4f} ± {x['se_ratio']:.4f} | {x['mean_mass']:.4f} | "
                      f"{x['outside']:.4f} | {x['tokens']:.0f} |", flush=True)
            checks = {
                "full: mean ratio = mean kept mass (within 2 s.e.)":
                    abs(m["full"]["mean_ratio"] - m["full"]["mean_mass"]) <= 2 * m["full"]["se_diff"],
                "replay: |mean ratio - 1| < 0.5%": abs(m["replay"]["mean_ratio"] - 1) < 0.005,
                "replay: outside [0.9, 1.1] at least 5x smaller than full":
                    0 < m["full"]["outside"] and m["replay"]["outside"] * 5 <= m["full"]["outside"],
            }
            for what, ok in checks.items():
                print(f"  {name}: {what}: {'PASS' if ok else 'FAIL'}")
                failed += not ok
    finally:
        shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
