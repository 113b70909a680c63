"""torchrun entry point: MoE rollout routing replay through the megatron hook (``--tis-routing-replay``).

    torchrun --nproc-per-node 1 tests/dist/routing_replay_worker.py --out DIR --plan single
    torchrun --nproc-per-node 2 tests/dist/routing_replay_worker.py --out DIR --plan layouts --ref DIR/ref.pt

Model: a megatron-core GPT (local spec, CPU) of 4 layers, the first dense and the others mixture-of-experts
(``moe_layer_freq=[0, 1, 1, 1]``), 4 experts, top-2 router. The rollout engine is the same model except its
router: every router weight perturbed (``ENGINE_NOISE``), run once on the whole batch in megatron's ``RECORD``
mode; its top-k per token and MoE layer are the batch's routed experts (the last position, which an engine
never runs, is ``-1``) and its log-probs the rollout log-probs.

A second engine differs from the trainer only in its routers' choice (the trainer's weights and router scores at
the perturbed routers' experts): with replay training computes exactly its network.

Plan ``single`` (1 process): the hook with and without replay (metrics, k3, gradient reaching the router),
replay under full activation recompute, through the rollout's pi_old pass, on packed rows, every bad input;
writes ``single.json`` and the references (loss, gradients by global name, metrics) to ``ref.pt``. Plan
``layouts`` (2 processes): PP=2 (dense first stage layer), PP=2 x 2 virtual stages, TP=2 (sequence parallel),
EP=2, CP=2, DP=2, PP=2 with recompute and PP=2 without replay, each against ``ref.pt`` (``RR_LAYOUTS`` selects
some); writes ``rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _cpu import cpu_shim

cpu_shim.enable_cuda_to_cpu_mode()

import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: E402
from _cpu.cpu_cp_attention import CPUContextParallelAttention  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from slime_tis import TISConfig  # noqa: E402
from slime_tis.engine.batch import cp_slice_padded  # noqa: E402
from slime_tis.megatron import RoutingBatch, TISBatch, tis_forward_backward_func  # noqa: E402
from slime_tis.megatron.routing_replay import RoutingReplay  # noqa: E402

if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 without transformer-engine: unbound name
    moe_utils.te_general_gemm = None

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, EXPERTS, TOPK, ROWS = 64, 16, 32, 4, 4, 4, 2, 8
PATTERN = [0, 1, 1, 1]
MOE_LAYERS = sum(PATTERN)
ENGINE_NOISE = 0.02
CFG = dict(use_tis=True, mode="truncate", level="token", upper=2.0)
LAYOUTS_ALL = {"tp2": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2), "cp2": dict(cp=2), "dp2": dict(),
           "pp2_recompute": dict(pp=2, recompute=True), "pp2_no_replay": dict(pp=2, plain=True),
           "pp2_vpp2": dict(pp=2, vpp=2)}
LAYOUTS = {k: LAYOUTS_ALL[k] for k in __import__("os").environ.get("RR_LAYOUTS", ",".join(LAYOUTS_ALL)).split(",")}


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm for sequence parallelism (megatron's torch wrapper refuses it): its weights are marked
    ``sequence_parallel``, so ``finalize_model_grads`` sums their gradients over TP."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = True


def setup(tp=1, pp=1, cp=1, ep=1, vpp=1, **_):
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        world = dist.distributed_c10d._world
        for pg in [pg for pg in list(world.pg_map) if pg is not dist.group.WORLD]:
            dist.destroy_process_group(pg)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)


def build(tp=1, pp=1, cp=1, ep=1, vpp=1, recompute=False, replay=True, plain=False, vp_stage=None):
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32, add_bias_linear=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, sequence_parallel=tp > 1,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, batch_p2p_comm=vpp == 1,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_layer_freq=list(PATTERN), moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_enable_routing_replay=replay, moe_token_dispatcher_type="allgather",
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute
           else {}))
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, vp_stage=vp_stage)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = CPUContextParallelAttention
        if tp > 1:
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    if tp > 1:
        spec.layer_norm = SequenceParallelLayerNorm
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    share_embeddings_and_output_weights=False, vp_stage=vp_stage)


def global_name(model, name: str) -> str:
    """Local name -> the name in the one-process model (global layer number, global expert index)."""
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        parts[i] = str(ps.get_expert_model_parallel_rank() * (EXPERTS // ps.get_expert_model_parallel_world_size())
                       + int(parts[i]))
    return ".".join(parts)


def shard(p, full):
    if not getattr(p, "tensor_model_parallel", False):
        return full
    expert = not getattr(p, "allreduce", True)
    size = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
    rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    return full.chunk(size, p.partition_dim)[rank] if size > 1 else full


def ddp_model(weights, **layout):
    """This rank's model chunks (one per virtual stage), wrapped in megatron DDP, and their parameters."""
    vpp = layout.get("vpp", 1)
    models = [build(**layout, vp_stage=i) for i in range(vpp)] if vpp > 1 else [build(**layout)]
    params, ddps = [], []
    for model in models:
        with torch.no_grad():
            for name, p in model.named_parameters():
                g = global_name(model, name)
                p.copy_(shard(p, weights[g]))
                params.append((name, p, g))
        model.config.finalize_model_grads_func = finalize_model_grads
        ddps.append(DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)))
        ddps[-1].zero_grad_buffer()
    return ddps, params


# ------------------------------------------------------------------------------------------------ data
def make_data():
    """Weights of the one-process model, tokens, masks, the engine's experts and log-probs (every rank the same)."""
    setup()
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "router" in n:
                p.mul_(8.0)  # spread the router logits: a small perturbation flips some decisions, not most
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.zeros(ROWS, 1, dtype=torch.long)], 1)
    pos = torch.arange(SEQ).expand(ROWS, SEQ)
    mask = (pos >= 3) & (pos < SEQ - 1 - torch.randint(0, 3, (ROWS, 1), generator=g))
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, SEQ).contiguous()
    # the engine: the same model with perturbed routers, recording its top-k
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "router" in n:
                p.add_(ENGINE_NOISE * torch.randn(p.shape, generator=g))
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    for r in routers:
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        logits = model(tokens, pos, None)
    recorded = [r.router_replay.get_recorded_indices() for r in routers]  # [S*B, k] each, s-major
    experts = torch.stack([x.view(SEQ, ROWS, TOPK).transpose(0, 1) for x in recorded], dim=2).to(torch.int16)
    # a second engine that differs from the trainer only in its routers' choice: the trainer's weights, the
    # perturbed routers' experts (replayed), the trainer's router scores at them
    model.load_state_dict(weights, strict=False)
    for r, x in zip(routers, recorded):
        r.router_replay.clear_indices()
        r.router_replay.set_target_indices(x)
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        logits_choice = model(tokens, pos, None)
    for r in routers:
        r.router_replay.clear_indices()
        r.router_replay.clear_router_replay_action()
    experts[:, -1] = -1  # the engine never runs the last token

    def lp(z):
        return torch.log_softmax(z.float(), -1).gather(-1, labels[..., None]).squeeze(-1)

    return dict(weights=weights, tokens=tokens, labels=labels, mask=mask, adv=adv, experts=experts,
                rollout=lp(logits), rollout_choice=lp(logits_choice))


def items_for(data, rows_per_mb, *, routing=True, experts=None, mask=None, rollout="rollout", packed=False):
    """This rank's micro-batch items; ``packed``: each micro-batch's rows as one packed row ``[1, rows * S]``."""
    cp, cpr = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    pos = torch.arange(SEQ).expand(ROWS, SEQ)
    out = []
    for rows in rows_per_mb:
        idx = torch.tensor(rows)

        def cut(x, idx=idx):
            x = x[idx]
            return x.reshape(1, -1, *x.shape[2:]) if packed else x

        seq_ids = torch.arange(len(rows)).repeat_interleave(SEQ).view(1, -1) if packed else None
        tb = TISBatch.from_padded(cut(data["labels"]), cut(data["mask"]).float(), cut(data["adv"]),
                                  cut(data[rollout]), seq_ids=seq_ids)
        item = {"tokens": cp_slice_padded(cut(data["tokens"]), cp, cpr),
                "position_ids": cp_slice_padded(cut(pos), cp, cpr), "tis": tb}
        if routing:
            e = cut(data["experts"] if experts is None else experts)
            item["routing"] = RoutingBatch(e, cut(data["mask"] if mask is None else mask), packed=packed)
        out.append(item)
    return out


def forward_step(data_iterator, model):
    item = next(data_iterator)
    return model(item["tokens"], item["position_ids"], None), None


def rows_of(dp, dp_rank, m):
    per = ROWS // (dp * m)
    return [[(k * dp + dp_rank) * per + j for j in range(per)] for k in range(m)]


def run(data, *, replay=True, metrics=True, m=2, layout=None, experts=None, mask=None, routing=True,
        old_pass=False, rollout="rollout", packed=False):
    """One hooked training step on this rank's rows; returns (metrics, {global name: main_grad})."""
    layout = layout or {}
    ddps, params = ddp_model(data["weights"], **layout)
    dp = ps.get_data_parallel_world_size()
    items = items_for(data, rows_of(dp, ps.get_data_parallel_rank(), m), routing=routing, experts=experts,
                      mask=mask, rollout=rollout, packed=packed)
    fb = tis_forward_backward_func(get_forward_backward_func(), TISConfig(**CFG), routing_replay=replay,
                                   routing_metrics=metrics, chunk_size=7)
    rows = len(items[0]["tis"].cu_seqlens) - 1
    kw = dict(model=ddps, num_microbatches=m, seq_length=SEQ * rows if packed else SEQ,
              micro_batch_size=1 if packed else rows)
    if old_pass:
        items = fb.compute_old_log_probs(forward_step_func=forward_step, data_iterator=iter(items), **kw)
    data_it = [iter(items) for _ in ddps] if len(ddps) > 1 else iter(items)
    fb(forward_step_func=forward_step, data_iterator=data_it, forward_only=False, **kw)
    grads = {g: p.main_grad.detach().clone() for _, p, g in params}  # this rank's shards
    return {k: float(v) for k, v in fb.last_metrics.items()}, grads, params


# ------------------------------------------------------------------------------------------------ plans
def one_line_error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def plan_single(out: Path) -> None:
    data = make_data()
    setup()
    res = {}
    replay, grads, params = run(data, replay=True)
    plain, plain_grads, _ = run(data, replay=False, metrics=True)
    res["replay"], res["plain"] = replay, plain
    res["router_grad_norm"] = sum(float(grads[g].norm()) for _, _, g in params if "router" in g)
    res["grad_diff_replay_vs_plain"] = max(float((grads[g] - plain_grads[g]).abs().max()) for g in grads)
    rec, rec_grads, _ = run(data, replay=True, layout=dict(recompute=True))
    res["recompute_metrics"] = rec
    res["recompute_grad_err"] = max(float((rec_grads[g] - grads[g]).abs().max()) for g in grads)
    old, _, _ = run(data, replay=True, old_pass=True)
    res["old_pass"] = old
    # the engine that differs only in its routers' choice: replay makes training its network exactly
    res["choice_replay"] = run(data, replay=True, rollout="rollout_choice")[0]
    res["choice_plain"] = run(data, replay=False, metrics=True, rollout="rollout_choice")[0]
    # sequence packing: each micro-batch's 4 rows as one packed row (the tokens the routers see, in order)
    res["packed"] = run(data, replay=True, packed=True)[0]
    torch.save({"replay": {"metrics": replay, "grads": grads}, "plain": {"metrics": plain, "grads": plain_grads}},
               out / "ref.pt")
    # bad input: one line each
    e = data["experts"]
    res["errors"] = {
        "no data": one_line_error(lambda: run(data, routing=False)),
        "layer count": one_line_error(lambda: run(data, experts=e[:, :, :2])),
        "k": one_line_error(lambda: run(data, experts=e[..., :1])),
        "shorter": one_line_error(lambda: run(data, experts=e[:, :-2], mask=data["mask"][:, :-2])),
        "not replay-enabled": one_line_error(lambda: RoutingReplay(replay=True, count=False)._attach(
            build(replay=False))),
    }
    (out / "single.json").write_text(json.dumps(res))


def plan_layouts(out: Path, ref_path: Path) -> None:
    data = make_data()
    refs = torch.load(ref_path, weights_only=True)
    results = []
    for name, layout in LAYOUTS.items():
        setup(**layout)
        ref = refs["plain" if layout.get("plain") else "replay"]
        try:
            metrics, grads, params = run(data, layout=layout, replay=not layout.get("plain"))
            err = max(float((grads[g] - shard(p, ref["grads"][g])).abs().max() / ref["grads"][g].abs().max()
                            .clamp(min=1e-8)) for _, p, g in params)
            row = {"layout": name, "grad_err": err}
            if ps.is_pipeline_last_stage():
                row["metric_errs"] = {k: abs(metrics[k] - v) / max(abs(v), 1e-6) for k, v in ref["metrics"].items()
                                      if not k.endswith("_time_s")}
                row["metrics"] = {k: metrics[k] for k in metrics if k.startswith(("moe/", "loss", "tis/k3"))}
            if layout.get("cp", 1) > 1:  # packed rows are split per sequence under CP: refused
                row["packed_cp"] = one_line_error(lambda layout=layout: run(data, layout=layout, packed=True))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            row = {"layout": name, "error": traceback.format_exc(limit=3), "msg": str(exc)}
        results.append(row)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", choices=("single", "layouts"), required=True)
    ap.add_argument("--ref")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = Path(a.out)
    if a.plan == "single":
        plan_single(out)
    else:
        plan_layouts(out, Path(a.ref))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
