"""torchrun worker: the hook's output-layer modes (``fused_output_layer``, ``fp32_lm_head``) through real steps.

    torchrun --nproc-per-node {1,2} tests/dist/output_layer_hook_worker.py --out DIR

Every rank writes ``DIR/rank{r}.jsonl``, one JSON line per check; ``test_megatron_output_layer.py`` asserts.

* ``fused_<layout>_<tied|untied>``: the same tiny megatron-core GPT (megatron DDP, the harness's data with its
  traps, algorithm 2 token truncate, M=2) through ``tis_forward_backward_func``: ``compute_old_log_probs`` then
  one training step, once unfused and once with ``fused_output_layer=True``; recorded: the largest pi_old
  difference, the loss / logged loss / every metric (``last_metrics`` and Megatron-LM's ``train_step`` report)
  of both, every parameter gradient's max-abs difference relative to its max-abs value, what the launcher's
  ``forward_step`` saw on the last stage in each pass (last dimension: hidden size or vocabulary shard), the
  model's output-layer mode after the calls. ``..._auto`` adds a fused step whose pi_old comes from the hook's
  per-call recompute (default ``pi_old="auto"``).
* ``misuse``: a model switched behind the hook's back (error messages), or by the launcher itself.
* ``fp32_<layout>``: a bf16 GPT (no DDP; output weight x40 so bf16 logit rounding matters): pi_old and a step
  in three modes (stock bf16 logits, ``fp32_lm_head``, ``fused``): the dtypes the launcher's ``forward_step``
  saw in the pi_old pass and in the training step, and pi_old differences between the modes.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _harness import (
    HEADS,
    HIDDEN,
    LAYERS,
    SEQ,
    TEMPERATURE,
    VOCAB,
    build_ddp_chunks,
    forward_step,
    full_weights_and_log_probs,
    init_distributed,
    logged_by_megatron_lm,
    make_global_batch,
    make_items,
    row_assignment,
    setup_parallel,
)
from _plans import CASES, LAYOUTS
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from slime_tis import TISConfig
from slime_tis.megatron import rollout_step_iterator, tis_forward_backward_func
from slime_tis.megatron.output_layer import output_layer_mode

CASE = "a2_tok_trunc"
M = 2


def _recording(seen: list):
    """The launcher's forward_step, recording (last dim, dtype) of the model output on the last stage."""

    def step(data_iterator, model):
        out, loss_func = forward_step(data_iterator, model)
        if ps.is_pipeline_last_stage():
            seen.append([int(out.shape[-1]), str(out.dtype)])
        return out, loss_func

    return step


def _tie(weights: dict) -> dict:
    """Tied embeddings: the output layer uses the word embedding (no output_layer.weight)."""
    return {k: v for k, v in weights.items() if k != "output_layer.weight"}


def _build(layout_name: str, weights: dict, tied: bool):
    layout = LAYOUTS[layout_name]
    if not tied:
        return build_ddp_chunks(layout, weights)
    import _harness

    original = _harness.GPTModel

    def tied_gpt(**kwargs):
        kwargs["share_embeddings_and_output_weights"] = True
        return original(**kwargs)

    _harness.GPTModel = tied_gpt
    try:
        return build_ddp_chunks(layout, weights)
    finally:
        _harness.GPTModel = original


def _one_run(ddps, items, mbs: int, *, fused: bool, rollout_pass: bool) -> dict:
    cfg = TISConfig(**CASES[CASE])
    fb = tis_forward_backward_func(get_forward_backward_func(), cfg, temperature=TEMPERATURE, chunk_size=5,
                                   fused_output_layer=fused)
    seen_old: list = []
    seen_train: list = []
    kw = dict(model=ddps, num_microbatches=M, seq_length=SEQ, micro_batch_size=mbs)
    if rollout_pass:
        items = fb.compute_old_log_probs(forward_step_func=_recording(seen_old), data_iterator=iter(items),
                                         num_steps=1, **kw)
        data = rollout_step_iterator(items, 0, M)
    else:
        data = iter(items)
    for d in ddps:
        d.zero_grad_buffer()
    out = fb(forward_step_func=_recording(seen_train), data_iterator=data, forward_only=False, **kw)
    res = {"seen_old": seen_old, "seen_train": seen_train, "recomputed": fb.last_recomputed,
           "mode_after": output_layer_mode(ddps), "grads": {}}
    for c, d in enumerate(ddps):
        for name, p in d.module.named_parameters():
            res["grads"][f"{c}.{name}"] = p.main_grad.detach().clone()
    if ps.is_pipeline_last_stage():
        res["metrics"] = {k: float(v) for k, v in fb.last_metrics.items()}
        res["logged"] = logged_by_megatron_lm(out)
        res["pi_old"] = [it["tis"].old_log_probs for it in items] if rollout_pass else None
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def check_fused(layout_name: str, weights: dict, lp_full: torch.Tensor, *, tied: bool, auto: bool) -> dict:
    layout = LAYOUTS[layout_name]
    if tied:
        weights = _tie(weights)
    batch = make_global_batch(lp_full)
    rows = row_assignment(layout.dp(dist.get_world_size()), ps.get_data_parallel_rank(), M)
    ddps, _ = _build(layout_name, weights, tied)
    ref = _one_run(ddps, make_items(batch, rows), len(rows[0]), fused=False, rollout_pass=True)
    got = _one_run(ddps, make_items(batch, rows), len(rows[0]), fused=True, rollout_pass=True)
    errs = {n: _rel(got["grads"][n], g) for n, g in ref["grads"].items()}
    worst = max(errs, key=errs.get)
    result = {"grad_err": errs[worst], "grad_err_param": worst, "n_params": len(errs),
              "same_params": sorted(got["grads"]) == sorted(ref["grads"]),
              "tied": ddps[0].module.share_embeddings_and_output_weights,
              "seen": {k: [got[k], ref[k]] for k in ("seen_old", "seen_train")},
              "mode_after": got["mode_after"], "last_stage": ps.is_pipeline_last_stage()}
    runs = {"fused": got}
    if auto:
        runs["auto"] = _one_run(ddps, make_items(batch, rows), len(rows[0]), fused=True, rollout_pass=False)
        errs = {n: _rel(runs["auto"]["grads"][n], g) for n, g in ref["grads"].items()}
        result.update(auto_grad_err=max(errs.values()), auto_recomputed=runs["auto"]["recomputed"],
                      auto_seen=runs["auto"]["seen_train"])
    if ps.is_pipeline_last_stage():
        result["pi_old_err"] = max(float((a - b).abs().max()) for a, b in zip(got["pi_old"], ref["pi_old"]))
        result["pi_old_finite"] = all(bool(torch.isfinite(a).all()) for a in got["pi_old"])
        result["metrics"] = {name: {k: [run[k], ref[k]] for k in ("metrics", "logged")}
                             for name, run in runs.items()}
    return result


def _bf16_gpt():
    from _cpu.cpu_cp_attention import CPUContextParallelAttention
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                            params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CPUContextParallelAttention
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=True, post_process=True, share_embeddings_and_output_weights=False).to(torch.bfloat16)
    with torch.no_grad():
        model.output_layer.weight.mul_(40.0)  # large logits: bf16 rounding of the logits matters
    return model


def check_fp32(layout_name: str, lp_full: torch.Tensor) -> dict:
    """Modes None / fp32 / fused on a bf16 model (no DDP, DP=1): dtypes per pass, pi_old differences."""
    model = _bf16_gpt()
    batch = make_global_batch(lp_full)
    rows = row_assignment(1, 0, M)
    cfg = TISConfig(**CASES[CASE])
    out = {}
    pi_old = {}
    for mode in ("stock", "fp32", "fused"):
        fb = tis_forward_backward_func(get_forward_backward_func(), cfg, temperature=TEMPERATURE, chunk_size=5,
                                       fp32_lm_head=mode == "fp32", fused_output_layer=mode == "fused")
        seen_old, seen_train = [], []
        kw = dict(model=[model], num_microbatches=M, seq_length=SEQ, micro_batch_size=len(rows[0]))
        items = fb.compute_old_log_probs(forward_step_func=_recording(seen_old),
                                         data_iterator=iter(make_items(batch, rows)), **kw)
        model.zero_grad(set_to_none=True)
        fb(forward_step_func=_recording(seen_train), data_iterator=iter(items), forward_only=False, **kw)
        pi_old[mode] = torch.cat([it["tis"].old_log_probs for it in items])
        grad = model.output_layer.weight.grad
        out[mode] = {"seen_old": seen_old, "seen_train": seen_train, "mode_after": output_layer_mode(model),
                     "loss": float(fb.last_metrics["loss"]),
                     "grad_finite": grad is not None and bool(torch.isfinite(grad).all())}
    valid = torch.cat([it["tis"].loss_mask for it in items]) != 0
    out["pi_old_fp32_vs_fused"] = float((pi_old["fp32"] - pi_old["fused"])[valid].abs().max())
    out["pi_old_stock_vs_fused"] = float((pi_old["stock"] - pi_old["fused"])[valid].abs().max())
    return out


def check_misuse(weights: dict, lp_full: torch.Tensor) -> dict:
    """A model switched behind the hook's back: hidden states never read as logits; modes never mixed."""
    from slime_tis.megatron.output_layer import restore_output_layer, use_fp32_lm_head, use_fused_output_layer

    batch = make_global_batch(lp_full)
    rows = row_assignment(1, 0, M)
    ddps, _ = build_ddp_chunks(LAYOUTS["single"], weights)
    out = {}
    for name, switch, fused in (("fused_model_plain_hook", use_fused_output_layer, False),
                                ("fp32_model_fused_hook", use_fp32_lm_head, True)):
        switch(ddps)
        try:
            _one_run(ddps, make_items(batch, rows), len(rows[0]), fused=fused, rollout_pass=False)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
        restore_output_layer(ddps)
    use_fused_output_layer(ddps)  # the launcher switched it itself, hook in the same mode: stays switched
    _one_run(ddps, make_items(batch, rows), len(rows[0]), fused=True, rollout_pass=False)
    out["kept_launchers_mode"] = output_layer_mode(ddps)
    restore_output_layer(ddps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed()
    torch.set_num_threads(1)
    world = dist.get_world_size()
    weights, lp_full = full_weights_and_log_probs()
    if world == 1:
        checks = [("fused_single_untied_auto", "single", dict(tied=False, auto=True)),
                  ("fused_single_tied", "single", dict(tied=True, auto=False)),
                  ("fp32_single", "single", None), ("misuse", "single", "misuse")]
    else:
        checks = [("fused_tp2_untied", "tp2", dict(tied=False, auto=False)),
                  ("fused_tp2_tied_auto", "tp2", dict(tied=True, auto=True)),
                  ("fused_pp2_untied", "pp2", dict(tied=False, auto=False)),
                  ("fp32_tp2", "tp2", None)]
    current = None
    with open(Path(args.out) / f"rank{dist.get_rank()}.jsonl", "w") as fh:
        for name, layout_name, kw in checks:
            if layout_name != current:
                setup_parallel(LAYOUTS[layout_name])
                current = layout_name
            try:
                if kw == "misuse":
                    res = check_misuse(weights, lp_full)
                elif kw is None:
                    res = check_fp32(layout_name, lp_full)
                else:
                    res = check_fused(layout_name, weights, lp_full, **kw)
            except Exception:  # reported per check (all ranks raise alike); the others still run
                res = {"error": traceback.format_exc()}
            res["name"] = name
            fh.write(json.dumps(res) + "\n")
            fh.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
