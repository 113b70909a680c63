"""torchrun entry point: the ``train_rl.py`` host (``slime_tis.megatron_rl``) under DP=2, PP=2, TP=2 on one launch.

    torchrun --nproc-per-node 2 tests/dist/megatron_rl_worker.py --out DIR

Every rank first computes the oracle (a TP=PP=1 copy of the tiny GPT, same weights, the whole global batch of
Megatron-LM RL rows, plain autograd, ``log_softmax(logits / T)`` and one core ``policy_loss``), then runs one
optimizer step per check through megatron-core's schedule (``get_forward_backward_func``, megatron DDP) with
:meth:`RLHost.forward_step` as the ``forward_step_func`` and this rank's Megatron-LM RL items (unpacked rows, or
its rows packed two to a bin with a block-causal attention mask: the same oracle), and
writes ``DIR/rank{r}.jsonl``: the gradient error of its shards, and on the last stage the loss and ``tis/*``
metrics as Megatron-LM's ``train_step`` logs them from the loss dicts; then, under DP=2, one rollout collection
trained in two optimizer steps (:func:`run_rollout`): its batch-normalisation factor; then, under CP=2, the host's
refusal of packed bins (:func:`run_cp_refused`).
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import _harness
import torch
import torch.distributed as dist
from _cpu.cpu_cp_attention import CPUContextParallelAttention
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
from _megatron_rl import pack_bins
from _plans import LAYOUTS, Layout
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from slime_tis import TISConfig, policy_loss
from slime_tis.core import LocalReducer, compute_tis
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.megatron_rl import RLHost

M = 2
RL_CASES = {
    "a2_seq_clip_bn_kl": dict(use_tis=True, level="sequence", mode="clip", upper=2.0, lower=0.5,
                              batch_normalize=True, kl_coef=0.05, entropy_coef=0.01),
    "a3_geo_mask_drop": dict(use_tis=True, use_rollout_log_probs=True, level="geometric", mode="mask", upper=1.2,
                             lower=0.85, rejected_denominator="drop", loss_agg="seq-mean-token-mean"),
}
CHECKS = [("dp2", "a2_seq_clip_bn_kl", False), ("pp2", "a2_seq_clip_bn_kl", False),
          ("tp2", "a2_seq_clip_bn_kl", False), ("dp2_pt", "a3_geo_mask_drop", False),
          ("tp2", "a3_geo_mask_drop", False), ("dp2", "a2_seq_clip_bn_kl", True), ("pp2", "a3_geo_mask_drop", True)]
BIN = 32


class MaskedAttention(CPUContextParallelAttention):
    """The CPU attention, honouring a given ``[1, 1, L, L]`` mask (True = masked: a packed bin's block-causal mask)
    where the model is given one (CP = 1 here)."""

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is None:
            return super().forward(query, key, value, attention_mask, *args, **kwargs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.scale)
        return ctx.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


_harness.CPUContextParallelAttention = MaskedAttention


def rl_batch(lp_full: torch.Tensor) -> dict:
    """Megatron-LM RL rows: ``tokens``/``loss_mask``/``position_ids`` ``[G, S]``, log-probs ``[G, S-1]``,
    advantages ``[G]`` (prompt 2-4 tokens, response to S-1..S-4, interior masked tokens)."""
    g = torch.Generator().manual_seed(21)
    tokens = _tokens(7)
    pos = torch.arange(SEQ)[None].expand(GLOBAL_ROWS, SEQ)
    prompt = torch.randint(2, 5, (GLOBAL_ROWS, 1), generator=g)
    end = torch.randint(SEQ - 4, SEQ + 1, (GLOBAL_ROWS, 1), generator=g)   # a sequence's length (packed)
    mask = ((pos >= prompt) & (pos < end)).float() * (torch.rand(GLOBAL_ROWS, SEQ, generator=g) > 0.1).float()
    lp = lp_full[:, :-1]
    return dict(tokens=tokens, pos=pos, mask=mask, length=end[:, 0], adv=torch.randn(GLOBAL_ROWS, generator=g),
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


def packed_items(b: dict, rows: list[list[int]]) -> list[tuple]:
    """This rank's rows packed into bins of ``BIN`` tokens, two sequences (12-16 tokens) a bin, one bin per
    micro-batch: ``2 * len(rows)`` bins of the ``4 * len(rows)`` rows on every rank."""
    r = sum(rows, [])
    idx = torch.tensor(r)
    lengths = [int(n) for n in b["length"][idx]]
    items = []
    for bin_ in pack_bins(b["tokens"][idx], lengths, b["mask"][idx].bool(), bin_size=BIN, max_per_bin=2):
        grids = {k: torch.zeros(1, BIN - 1) for k in ("old", "ref", "inf")}
        for i, start in zip(bin_.seq_indices, bin_.seq_starts):
            for k in grids:
                grids[k][0, start:start + lengths[i] - 1] = b[k][r[i], :lengths[i] - 1]
        items.append((bin_, b["adv"][idx][bin_.seq_indices], grids["old"], grids["ref"], grids["inf"]))
    assert len(items) == len(r) // 2
    return items


def run(layout_name: str, case: str, packed: bool, weights: dict, b: dict, ref) -> dict:
    layout = LAYOUTS[layout_name]
    setup_parallel(layout)
    dp = layout.dp(dist.get_world_size())
    rows = row_assignment(dp, ps.get_data_parallel_rank(), M)
    ddps, params = build_ddp_chunks(layout, weights)
    if packed:
        items = packed_items(b, rows)
    else:
        items = [tuple(b[k][torch.tensor(r)] for k in ("tokens", "adv", "old", "mask", "pos", "ref", "inf"))
                 for r in rows]
    host = RLHost(TISConfig(**RL_CASES[case]), len(items), temperature=TEMPERATURE, per_token=layout.per_token,
                  packed=packed)
    out = get_forward_backward_func()(forward_step_func=host.forward_step, data_iterator=iter(items), model=ddps,
                                      num_microbatches=len(items), seq_length=BIN if packed else SEQ,
                                      micro_batch_size=1 if packed else len(rows[0]), forward_only=False)
    res = {"layout": layout_name, "case": case, "packed": packed, "rank": dist.get_rank(),
           **grad_errors(params, ref[1])}
    if ps.is_pipeline_last_stage():
        logged = logged_by_megatron_lm(out)
        res.update(loss=logged.get("lm loss"), oracle_loss=ref[0],
                   metric_errs={k: abs(logged[k] - v) / max(abs(v), 1e-2) for k, v in ref[2].items() if k in logged},
                   missing=sorted(set(ref[2]) - set(logged)))
    return res


def run_rollout(weights: dict, b: dict) -> dict:
    """DP=2, algorithm 2 with batch normalisation, one collection of 2 micro-batches a rank trained in 2 optimizer
    steps of 1: the factor ``begin_rollout`` takes (reduced over DP), the factor each step uses, and the oracle:
    the core's ``compute_tis`` on the whole global batch, ``count / sum``."""
    cfg = TISConfig(**RL_CASES["a2_seq_clip_bn_kl"])
    n = SEQ - 1
    whole = compute_tis(cfg, b["old"].reshape(-1), b["inf"].reshape(-1), b["mask"][:, 1:].reshape(-1),
                        torch.arange(GLOBAL_ROWS + 1) * n)
    setup_parallel(LAYOUTS["dp2"])
    rows = row_assignment(ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), M)
    ddps, _ = build_ddp_chunks(LAYOUTS["dp2"], weights)
    items = [tuple(b[k][torch.tensor(r)] for k in ("tokens", "adv", "old", "mask", "pos", "ref", "inf")) for r in rows]
    mine = torch.tensor(sum(rows, []))
    local = compute_tis(cfg, b["old"][mine].reshape(-1), b["inf"][mine].reshape(-1),
                        b["mask"][mine, 1:].reshape(-1), torch.arange(len(mine) + 1) * n)
    host = RLHost(cfg, 1, temperature=TEMPERATURE)
    it = iter(host.begin_rollout(items))
    steps = []
    for _ in range(M):
        get_forward_backward_func()(forward_step_func=host.forward_step, data_iterator=it, model=ddps,
                                    num_microbatches=1, seq_length=SEQ, micro_batch_size=len(rows[0]),
                                    forward_only=False)
        steps.append(float(host.engine.totals.batch_norm_factor))
    return {"kind": "rollout", "rank": dist.get_rank(), "factor": float(host.rollout_factor), "steps": steps,
            "oracle": float(whole.norm_count / whole.norm_sum), "rank_only": float(local.norm_count / local.norm_sum)}


def run_cp_refused(b: dict) -> dict:
    """CP=2 (megatron-core's parallel state, both ranks one CP group) with sequence-packed bins: the host's
    ``begin_rollout`` and ``forward_step`` refuse before any collective or forward, in one line naming
    ``--context-parallel-size 2`` and ``--rl-use-sequence-packing`` (unpacked rows are split across the CP ranks:
    tests/dist/test_megatron_rl_real_tree.py)."""
    setup_parallel(LAYOUTS["cp2"])
    item = tuple(b[k][:2] for k in ("tokens", "adv", "old", "mask", "pos", "ref", "inf"))
    messages = []
    for call in (lambda h: h.begin_rollout([item]), lambda h: h.forward_step(iter([item]), None)):
        try:
            call(RLHost(TISConfig(**RL_CASES["a2_seq_clip_bn_kl"]), 1, packed=True, temperature=TEMPERATURE))
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return {"kind": "cp_refused", "rank": dist.get_rank(), "cp": ps.get_context_parallel_world_size(),
            "messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    init_distributed()
    weights, lp_full = full_weights_and_log_probs()
    b = rl_batch(lp_full)
    refs = {case: oracle(TISConfig(**RL_CASES[case]), weights, b) for case in RL_CASES}
    lines = []
    for layout_name, case, packed in CHECKS:
        try:
            lines.append(run(layout_name, case, packed, weights, b, refs[case]))
        except Exception:  # recorded, not raised: the other checks still run, the test names the failure
            lines.append({"layout": layout_name, "case": case, "packed": packed, "rank": dist.get_rank(),
                          "error": traceback.format_exc()[-3000:]})
    try:
        lines.append(run_rollout(weights, b))
    except Exception:
        lines.append({"kind": "rollout", "rank": dist.get_rank(), "error": traceback.format_exc()[-3000:]})
    try:
        lines.append(run_cp_refused(b))
    except Exception:
        lines.append({"kind": "cp_refused", "rank": dist.get_rank(), "error": traceback.format_exc()[-3000:]})
    with open(out / f"rank{dist.get_rank()}.jsonl", "w") as fh:
        fh.writelines(json.dumps(line) + "\n" for line in lines)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
