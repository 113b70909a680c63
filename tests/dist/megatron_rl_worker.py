"""torchrun entry point: the ``train_rl.py`` host (``slime_tis.megatron_rl``) under DP=2, PP=2, TP=2 on one launch.

    torchrun --nproc-per-node 2 tests/dist/megatron_rl_worker.py --out DIR

Every rank first computes the oracle (a TP=PP=1 copy of the tiny GPT, same weights, the whole global batch of
Megatron-LM RL rows, plain autograd, ``log_softmax(logits / T)`` and one core ``policy_loss``), then runs one
optimizer step per check through megatron-core's schedule (``get_forward_backward_func``, megatron DDP) with
:meth:`RLHost.forward_step` as the ``forward_step_func`` and this rank's unpacked Megatron-LM RL items, and
writes ``DIR/rank{r}.jsonl``: the gradient error of its shards, and on the last stage the loss and ``tis/*``
metrics as Megatron-LM's ``train_step`` logs them from the loss dicts.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _harness import (
    GLOBAL_ROWS,
    SEQ,
    TEMPERATURE,
    _tokens,
    build_ddp_chunks,
    build_model,
    full_forward,
    full_weights_and_log_probs,
    grad_errors,
    init_distributed,
    logged_by_megatron_lm,
    row_assignment,
    setup_parallel,
)
from _plans import LAYOUTS, Layout
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from slime_tis import TISConfig, policy_loss
from slime_tis.core import LocalReducer
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.megatron_rl import RLHost

M = 2
RL_CASES = {
    "a2_seq_clip_bn_kl": dict(use_tis=True, level="sequence", mode="clip", upper=2.0, lower=0.5,
                              batch_normalize=True, kl_coef=0.05, entropy_coef=0.01),
    "a3_geo_mask_drop": dict(use_tis=True, use_rollout_log_probs=True, level="geometric", mode="mask", upper=1.2,
                             lower=0.85, rejected_denominator="drop", loss_agg="seq-mean-token-mean"),
}
CHECKS = [("dp2", "a2_seq_clip_bn_kl"), ("pp2", "a2_seq_clip_bn_kl"), ("tp2", "a2_seq_clip_bn_kl"),
          ("dp2_pt", "a3_geo_mask_drop"), ("tp2", "a3_geo_mask_drop")]


def rl_batch(lp_full: torch.Tensor) -> dict:
    """Megatron-LM RL rows: ``tokens``/``loss_mask``/``position_ids`` ``[G, S]``, log-probs ``[G, S-1]``,
    advantages ``[G]`` (prompt 2-4 tokens, response to S-1..S-4, interior masked tokens)."""
    g = torch.Generator().manual_seed(21)
    tokens = _tokens(7)
    pos = torch.arange(SEQ)[None].expand(GLOBAL_ROWS, SEQ)
    prompt = torch.randint(2, 5, (GLOBAL_ROWS, 1), generator=g)
    end = torch.randint(SEQ - 4, SEQ + 1, (GLOBAL_ROWS, 1), generator=g)
    mask = ((pos >= prompt) & (pos < end)).float() * (torch.rand(GLOBAL_ROWS, SEQ, generator=g) > 0.1).float()
    lp = lp_full[:, :-1]
    return dict(tokens=tokens, pos=pos, mask=mask, adv=torch.randn(GLOBAL_ROWS, generator=g),
                inf=lp + 0.3 * torch.randn(lp.shape, generator=g), old=lp + 0.15 * torch.randn(lp.shape, generator=g),
                ref=lp + 0.2 * torch.randn(lp.shape, generator=g))


def oracle(cfg: TISConfig, weights: dict, b: dict) -> tuple[float, dict, dict]:
    model = build_model(Layout(), pre=True, post=True)
    model.load_state_dict(weights, strict=False)
    log_p = torch.log_softmax(full_forward(model, b["tokens"])[:, :-1].float() / TEMPERATURE, -1)
    lp = log_p.gather(-1, b["tokens"][:, 1:, None]).squeeze(-1).reshape(-1)
    h = -(log_p.exp() * log_p).sum(-1).reshape(-1)
    n = SEQ - 1
    out = policy_loss(cfg, lp, b["old"].reshape(-1) if cfg.needs_old_log_probs else None, b["inf"].reshape(-1),
                      b["adv"][:, None].expand(GLOBAL_ROWS, n).reshape(-1), b["mask"][:, 1:].reshape(-1),
                      torch.arange(GLOBAL_ROWS + 1) * n, lp_ref=b["ref"].reshape(-1) if cfg.kl_coef else None,
                      entropy=h)
    out.loss.backward()
    metrics = {k: float(v) for k, v in aggregate_metrics([out.stats.detach()], LocalReducer()).items()
               if k.startswith("tis/")}
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return float(out.loss.detach()), grads, metrics


def run(layout_name: str, case: str, weights: dict, b: dict, ref) -> dict:
    layout = LAYOUTS[layout_name]
    setup_parallel(layout)
    dp = layout.dp(dist.get_world_size())
    rows = row_assignment(dp, ps.get_data_parallel_rank(), M)
    ddps, params = build_ddp_chunks(layout, weights)
    items = [tuple(b[k][torch.tensor(r)] for k in ("tokens", "adv", "old", "mask", "pos", "ref", "inf")) for r in rows]
    host = RLHost(TISConfig(**RL_CASES[case]), M, temperature=TEMPERATURE, per_token=layout.per_token)
    out = get_forward_backward_func()(forward_step_func=host.forward_step, data_iterator=iter(items), model=ddps,
                                      num_microbatches=M, seq_length=SEQ, micro_batch_size=len(rows[0]),
                                      forward_only=False)
    res = {"layout": layout_name, "case": case, "rank": dist.get_rank(), **grad_errors(params, ref[1])}
    if ps.is_pipeline_last_stage():
        logged = logged_by_megatron_lm(out)
        res.update(loss=logged.get("lm loss"), oracle_loss=ref[0],
                   metric_errs={k: abs(logged[k] - v) / max(abs(v), 1e-2) for k, v in ref[2].items() if k in logged},
                   missing=sorted(set(ref[2]) - set(logged)))
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    init_distributed()
    weights, lp_full = full_weights_and_log_probs()
    b = rl_batch(lp_full)
    refs = {case: oracle(TISConfig(**RL_CASES[case]), weights, b) for case in RL_CASES}
    lines = []
    for layout_name, case in CHECKS:
        try:
            lines.append(run(layout_name, case, weights, b, refs[case]))
        except Exception:  # recorded, not raised: the other checks still run, the test names the failure
            lines.append({"layout": layout_name, "case": case, "rank": dist.get_rank(),
                          "error": traceback.format_exc()[-3000:]})
    with open(out / f"rank{dist.get_rank()}.jsonl", "w") as fh:
        fh.writelines(json.dumps(line) + "\n" for line in lines)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
