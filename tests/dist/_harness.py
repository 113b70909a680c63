"""Test harness for the megatron hook in real torchrun processes (gloo, CPU): model, data, oracle, one case.

Each case compares the hooked megatron step under a parallel layout with an independent oracle that
every rank computes locally first: a TP=PP=CP=1 copy of the same GPT (same weights) run on the whole
global batch with plain autograd, ``log_softmax(logits / tau).gather(labels)`` and one core
``policy_loss`` call (no schedule, no hook, no reducer). Compared: the global loss, every parameter
gradient (this rank's shard of the oracle gradient) and the finalized metrics.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from _cpu import cpu_shim

cpu_shim.enable_cuda_to_cpu_mode()

from _cpu.cpu_cp_attention import CPUContextParallelAttention  # noqa: E402
from _plans import CASES, LAYOUTS, Layout  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from slime_tis import MetricStats, TISConfig, policy_loss  # noqa: E402
from slime_tis.core import LocalReducer, loss_denominator  # noqa: E402
from slime_tis.engine.batch import cp_slice_padded  # noqa: E402
from slime_tis.megatron import TISBatch, tis_forward_backward_func  # noqa: E402

VOCAB, SEQ, HIDDEN, LAYERS, HEADS = 64, 16, 32, 4, 4
GLOBAL_ROWS = 8
TEMPERATURE = 0.8


def init_distributed() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def setup_parallel(layout: Layout) -> None:
    """(Re-)initialise megatron model parallel; the previous layout's process groups are destroyed.

    Without destroying them every re-initialisation leaks a few dozen gloo groups (with their threads).
    """
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        world = dist.distributed_c10d._world
        for pg in [pg for pg in list(world.pg_map) if pg is not dist.group.WORLD]:
            dist.destroy_process_group(pg)
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
                                 context_parallel_size=layout.cp, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)


def build_model(layout: Layout, *, pre: bool | None = None, post: bool | None = None,
                vp_stage: int | None = None) -> GPTModel:
    """Tiny GPT with the local spec (CPU CP attention); parallel sizes also in the config (megatron reads
    them from both ``parallel_state`` and ``TransformerConfig``; they must agree)."""
    vpp = layout.vpp if layout.vpp > 1 else None
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, calculate_per_token_loss=layout.per_token,
        virtual_pipeline_model_parallel_size=vpp,
        # gloo: batched P2P (batch_isend_irecv) with PP=2 sends activations and gradients to the same peer
        # with the same tag and shape, and the interleaved schedule then receives them swapped (wrong
        # activations for later micro-batches, silently). Unbatched P2P keeps the order. NCCL is unaffected.
        batch_p2p_comm=vpp is None,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CPUContextParallelAttention
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
                    if pre is None else pre,
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
                    if post is None else post,
                    share_embeddings_and_output_weights=False, vp_stage=vp_stage)


def global_name(model: torch.nn.Module, name: str) -> str:
    """Local parameter name -> name in the TP=PP=1 model (pipeline stages number their layers from 0)."""
    if name.startswith("decoder.layers."):
        idx = int(name.split(".")[2])
        number = model.decoder.layers[idx].layer_number - 1
        return ".".join(["decoder", "layers", str(number), *name.split(".")[3:]])
    return name


def tp_shard(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice of a full (TP=1) tensor for ``param``."""
    if getattr(param, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
        return full.chunk(ps.get_tensor_model_parallel_world_size(), param.partition_dim)[
            ps.get_tensor_model_parallel_rank()]
    return full


# ------------------------------------------------------------------------------------------------ data
@dataclass
class GlobalBatch:
    tokens: torch.Tensor        # [G, S]
    labels: torch.Tensor        # [G, S]
    loss_mask: torch.Tensor     # [G, S] float
    advantages: torch.Tensor    # [G, S]
    rollout: torch.Tensor       # [G, S]
    seq_ids: torch.Tensor       # [G, S] global sequence id (non-decreasing)
    n_seq: int = 0
    extra: dict = field(default_factory=dict)
    ref: torch.Tensor | None = None  # [G, S] reference-policy log-probs


def make_global_batch(lp_full: torch.Tensor, *, masked_rank_rows: tuple[int, ...] = (), seed: int = 7
                      ) -> GlobalBatch:
    """Deterministic RL batch: prompts, responses, padding, 2 sequences in some rows, NaN/veto traps."""
    g = torch.Generator().manual_seed(seed)
    tokens = _tokens(seed)
    labels = torch.cat([tokens[:, 1:], torch.zeros(GLOBAL_ROWS, 1, dtype=torch.long)], 1)
    pos = torch.arange(SEQ)[None, :].expand(GLOBAL_ROWS, SEQ)
    prompt = torch.randint(2, 5, (GLOBAL_ROWS, 1), generator=g)
    end = torch.randint(SEQ - 4, SEQ, (GLOBAL_ROWS, 1), generator=g)
    mask = ((pos >= prompt) & (pos < end)).float()
    # rows 1 and 5 pack two sequences: the first one ends at position 4 (inside CP rank 0's first chunk)
    seq_in_row = torch.zeros(GLOBAL_ROWS, SEQ, dtype=torch.long)
    for r in (1, 5):
        seq_in_row[r, 4:] = 1
        mask[r, 3:5] = 0  # boundary: first sequence ends, second starts with a prompt token
        mask[r, 0:3] = torch.tensor([0.0, 1.0, 1.0])
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), seq_in_row[:-1, -1] + 1]), 0)
    seq_ids = seq_in_row + offsets[:, None]
    n_seq = int(seq_ids.max()) + 1
    for r in masked_rank_rows:
        mask[r] = 0
    seq_adv = torch.randn(n_seq, generator=g)
    advantages = seq_adv[seq_ids]
    rollout = lp_full + 0.3 * torch.randn(GLOBAL_ROWS, SEQ, generator=g)
    rollout[2, 6] = lp_full[2, 6] + 6.0          # catastrophic token: ratio exp(-6) < veto threshold
    rollout[3, 7] = float("nan")                 # non-finite at a valid token: sequence rejected
    rollout[4, 0] = float("inf")                 # non-finite at a masked (prompt) position: ignored
    advantages[6, SEQ - 1] = float("nan")        # masked position (label of the last token)
    ref = lp_full + 0.2 * torch.randn(GLOBAL_ROWS, SEQ, generator=g)  # reference policy (KL term)
    return GlobalBatch(tokens, labels, mask, advantages, rollout, seq_ids, n_seq, ref=ref)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=torch.Generator().manual_seed(seed + 1))


def cu_seqlens_of(seq_ids: torch.Tensor, n_seq: int) -> torch.Tensor:
    flat = seq_ids.reshape(-1)
    return torch.searchsorted(flat, torch.arange(n_seq + 1))


def full_forward(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1])[None, :].expand_as(tokens)
    return model(tokens, pos, None)  # [B, S, V]


def naive_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, labels[..., None]).squeeze(-1)


# ------------------------------------------------------------------------------------------------ oracle
@dataclass
class Oracle:
    loss: float
    grads: dict[str, torch.Tensor]
    metrics: dict[str, float]


def oracle(cfg: TISConfig, weights: dict[str, torch.Tensor], batch: GlobalBatch, *,
           microbatch_rows: list[list[int]]) -> Oracle:
    """Plain autograd on the TP=PP=CP=1 model and the whole batch (one ``policy_loss`` call).

    Algorithm 3 with batch normalisation normalises per micro-batch over DP x CP (docs/semantics.md), i.e. per *global*
    micro-batch ``k`` (the union of micro-batch ``k`` of every DP rank): ``microbatch_rows`` gives them and
    the oracle then calls ``policy_loss`` once per global micro-batch with the global denominator.
    """
    model = build_model(Layout(), pre=True, post=True)
    model.load_state_dict(weights, strict=False)
    logits = full_forward(model, batch.tokens)
    lp = naive_log_probs(logits, batch.labels)
    log_p = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    groups = microbatch_rows if (cfg.algorithm == 3 and cfg.batch_normalize) else [list(range(GLOBAL_ROWS))]
    den = None
    if len(groups) > 1:
        assert cfg.rejected_denominator == "keep"
        den = loss_denominator(cfg, batch.loss_mask.reshape(-1), cu_seqlens_of(batch.seq_ids, batch.n_seq))
    total = torch.zeros(())
    stats = MetricStats()
    for rows in groups:
        sl = (torch.tensor(rows),)
        ids = batch.seq_ids[sl]
        ids = ids - ids.min()
        cu = cu_seqlens_of(ids, int(ids.max()) + 1)
        out = policy_loss(cfg, lp[sl].reshape(-1), lp[sl].reshape(-1).detach(), batch.rollout[sl].reshape(-1),
                          batch.advantages[sl].reshape(-1), batch.loss_mask[sl].reshape(-1), cu,
                          reducer=LocalReducer(), denominator=den, lp_ref=batch.ref[sl].reshape(-1),
                          entropy=entropy[sl].reshape(-1))
        total = total + out.loss
        stats = stats.merge(out.stats)
    total.backward()
    metrics = {k: float(v) for k, v in stats.finalize().items()}
    metrics["loss"] = float(total.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Oracle(float(total.detach()), grads, metrics)


# ------------------------------------------------------------------------------------------------ one case
def row_assignment(dp: int, dp_rank: int, num_microbatches: int) -> list[list[int]]:
    """Rows of each of this DP rank's micro-batches: global micro-batch k = rows of all DP ranks' k."""
    mbs = GLOBAL_ROWS // (dp * num_microbatches)
    return [[(k * dp + dp_rank) * mbs + j for j in range(mbs)] for k in range(num_microbatches)]


def forward_step(data_iterator, model):
    item = next(data_iterator)
    out = model(item["tokens"], item["position_ids"], None)

    def unused_loss(output_tensor):  # the launcher's own loss: replaced by the hook on the last stage
        raise AssertionError("the launcher's loss function must not be called")

    return out, unused_loss


def global_microbatches(dp: int, num_microbatches: int) -> list[list[int]]:
    all_rows = [row_assignment(dp, d, num_microbatches) for d in range(dp)]
    return [sum((all_rows[d][k] for d in range(dp)), []) for k in range(num_microbatches)]


def oracle_for(layout_name: str, case_name: str, num_microbatches: int, *, weights: dict[str, torch.Tensor],
               lp_full: torch.Tensor, masked_rank_rows: tuple[int, ...] = ()) -> Oracle:
    """The oracle of a check; call while model parallel is initialised with TP=PP=CP=1."""
    dp = LAYOUTS[layout_name].dp(dist.get_world_size())
    batch = make_global_batch(lp_full, masked_rank_rows=masked_rank_rows)
    return oracle(TISConfig(**CASES[case_name]), weights, batch,
                  microbatch_rows=global_microbatches(dp, num_microbatches))


def build_ddp_chunks(layout: Layout, weights: dict[str, torch.Tensor], *, average_in_collective: bool = False):
    """This rank's model chunks with the global ``weights`` loaded (TP/PP shards), wrapped in megatron DDP.

    Returns ``(ddps, params)`` with ``params`` = ``[(local name, parameter, global name)]`` over all chunks.
    """
    chunks = ([build_model(layout, vp_stage=i) for i in range(layout.vpp)] if layout.vpp > 1
              else [build_model(layout)])
    params = []
    with torch.no_grad():
        for c, chunk in enumerate(chunks):
            for name, p in chunk.named_parameters():
                gname = global_name(chunk, name)
                params.append((f"chunk{c}.{name}", p, gname))
                p.copy_(tp_shard(p, weights[gname]))
    ddps = []
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = finalize_model_grads
        ddps.append(DistributedDataParallel(config=chunk.config, module=chunk,
                                            ddp_config=DistributedDataParallelConfig(
                                                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False,
                                                average_in_collective=average_in_collective)))
        ddps[-1].zero_grad_buffer()
    return ddps, params


def make_items(batch: GlobalBatch, rows: list[list[int]]) -> list[dict]:
    """This rank's micro-batch items (CP-local) for the given rows of each micro-batch."""
    cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    items = []
    for rws in rows:
        idx = torch.tensor(rws)
        ids = batch.seq_ids[idx] - batch.seq_ids[idx].min()
        tb = TISBatch.from_padded(batch.labels[idx], batch.loss_mask[idx], batch.advantages[idx],
                                  batch.rollout[idx], seq_ids=ids, ref_log_probs=batch.ref[idx])
        pos = torch.arange(SEQ)[None, :].expand(len(rws), SEQ)
        items.append({"tokens": cp_slice_padded(batch.tokens[idx], cp_size, cp_rank),
                      "position_ids": cp_slice_padded(pos, cp_size, cp_rank), "tis": tb})
    return items


def forward_step_tp0_data(data_iterator, model):
    """A Megatron-LM style ``forward_step``: only TP rank 0 has a data iterator; the tokens and positions
    are broadcast to the other TP ranks (as Megatron-LM's ``get_batch`` does)."""
    group = ps.get_tensor_model_parallel_group()
    src = dist.get_global_rank(group, 0)
    shape = torch.zeros(2, dtype=torch.long)
    if ps.get_tensor_model_parallel_rank() == 0:
        item = next(data_iterator)
        tokens, pos = item["tokens"], item["position_ids"].contiguous()
        shape = torch.tensor(tokens.shape)
    dist.broadcast(shape, src, group=group)
    if ps.get_tensor_model_parallel_rank() != 0:
        tokens = torch.empty(tuple(shape.tolist()), dtype=torch.long)
        pos = torch.empty_like(tokens)
    dist.broadcast(tokens, src, group=group)
    dist.broadcast(pos, src, group=group)
    return model(tokens, pos, None), None


class OpaqueWrapper(torch.nn.Module):
    """A data-parallel wrapper the hook does not know (it cannot tell how it reduces gradients)."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner
        self.config = inner.config

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor):
        self.module.set_input_tensor(tensor)


def grad_errors(params, grads: dict[str, torch.Tensor]) -> dict:
    """Max relative error of this rank's ``main_grad`` shards against full reference ``grads``."""
    res = {"grad_err": 0.0, "grad_err_param": None, "n_params": 0, "finite": True}
    for name, p, gname in params:
        g = p.main_grad.float()
        exp = tp_shard(p, grads[gname]).float()
        err = float((g - exp).abs().max() / exp.abs().max().clamp(min=1e-8))
        res["finite"] &= bool(torch.isfinite(g).all())
        res["n_params"] += 1
        if err > res["grad_err"]:
            res["grad_err"], res["grad_err_param"] = err, name
    return res


def logged_by_megatron_lm(out: list[dict]) -> dict[str, float]:
    """What Megatron-LM's ``train_step`` would log from the schedule's loss dicts (tests/_megatron_lm.py)."""
    from _megatron_lm import train_step_loss_reduced

    logged = train_step_loss_reduced(out, ps.get_data_parallel_group(with_context_parallel=True))
    return {k: float(v) for k, v in logged.items()}


def _schedule_passing_a_keyword(schedule):
    def wrapped(*, forward_step_func, **kwargs):
        def with_keyword(data_iterator, model, *args):
            return forward_step_func(data_iterator, model, *args, return_schedule_plan=False)

        return schedule(forward_step_func=with_keyword, **kwargs)

    return wrapped


def run_case(layout_name: str, case_name: str, num_microbatches: int, *, weights: dict[str, torch.Tensor],
             lp_full: torch.Tensor, ref: Oracle, reducer_factory=None, masked_rank_rows: tuple[int, ...] = (),
             fb_factory=None, tp0_data: bool = False, average_in_collective: bool = False,
             opaque_wrapper: bool = False, schedule_keyword: bool = False,
             no_rollout_dp_rank: int | None = None, via_train_step: bool = False) -> dict:
    """Run one (layout, case, M) under the current model-parallel layout; this rank's errors vs ``ref``.

    ``tp0_data``: only TP rank 0 gets a data iterator (Megatron-LM's default); ``opaque_wrapper``: the DDP
    chunks are hidden behind a wrapper the hook cannot read (the call must raise); ``schedule_keyword``: the
    schedule calls ``forward_step_func(it, model, return_schedule_plan=False)`` (as megatron's combined 1F1B
    schedule does with ``True``) and the launcher's ``forward_step`` must receive it on every call;
    ``no_rollout_dp_rank``: that DP rank's items carry no rollout log-probs (algorithm 0, diagnostics optional);
    ``via_train_step``: Megatron-LM's real ``train_step`` runs the step and its ``loss_reduced`` is what is logged.
    """
    layout = LAYOUTS[layout_name]
    cfg = TISConfig(**CASES[case_name])
    batch = make_global_batch(lp_full, masked_rank_rows=masked_rank_rows)
    dp = layout.dp(dist.get_world_size())
    assert ps.get_tensor_model_parallel_world_size() == layout.tp and ps.get_data_parallel_world_size() == dp
    rows = row_assignment(dp, ps.get_data_parallel_rank(), num_microbatches)
    ddps, params = build_ddp_chunks(layout, weights, average_in_collective=average_in_collective)
    items = make_items(batch, rows)
    if no_rollout_dp_rank == ps.get_data_parallel_rank():
        for it in items:
            it["tis"].rollout_log_probs = None
    base_fb = get_forward_backward_func()
    seen_keywords: list = []
    if schedule_keyword:
        base_fb = _schedule_passing_a_keyword(base_fb)
    reducer = reducer_factory() if reducer_factory else None
    fb = fb_factory(cfg) if fb_factory else tis_forward_backward_func(base_fb, cfg, temperature=TEMPERATURE,
                                                                      chunk_size=5, reducer=reducer)
    data = [iter(items) for _ in ddps] if layout.vpp > 1 else iter(items)
    step = forward_step
    if schedule_keyword:
        def step(data_iterator, model, **kwargs):
            seen_keywords.append(kwargs)
            return forward_step(data_iterator, model)
    if tp0_data:
        step = forward_step_tp0_data
        if ps.get_tensor_model_parallel_rank() != 0:
            data = None
    model = [OpaqueWrapper(d) for d in ddps] if opaque_wrapper else ddps
    if via_train_step:
        from _megatron_lm_real import train_step

        logged_real = train_step(step, data, model, fb, num_microbatches=num_microbatches,
                                 micro_batch_size=len(rows[0]), dp=dp, seq_length=SEQ)
        out = None
    else:
        out = fb(forward_step_func=step, data_iterator=data, model=model,
                 num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=len(rows[0]),
                 forward_only=False)

    result = {"layout": layout_name, "case": case_name, "M": num_microbatches, "rank": dist.get_rank(),
              "last_stage": ps.is_pipeline_last_stage(), **grad_errors(params, ref.grads),
              "seen_keywords": seen_keywords}
    if ps.is_pipeline_last_stage():
        metrics = {k: float(v) for k, v in fb.last_metrics.items()} if hasattr(fb, "last_metrics") else {}
        logged = dict(logged_real) if via_train_step else logged_by_megatron_lm(out)
        result.update(loss=metrics.get("loss", math.nan), oracle_loss=ref.loss, logged_loss=logged.pop("loss"),
                      logged_metrics=logged,
                      metric_errs={k: abs(metrics[k] - v) / max(abs(v), 1e-6) for k, v in ref.metrics.items()
                                   if k in metrics},
                      missing_metrics=sorted(set(ref.metrics) - set(metrics)),
                      metrics=metrics, oracle_metrics=ref.metrics)
    return result


def full_weights_and_log_probs() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Deterministic full-model weights (same on every rank) and their log-probs of the data's labels."""
    setup_parallel(Layout())
    torch.manual_seed(0)
    model = build_model(Layout(), pre=True, post=True)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None
               and isinstance(v, torch.Tensor)}
    with torch.no_grad():
        tokens = _tokens(7)
        labels = torch.cat([tokens[:, 1:], torch.zeros(GLOBAL_ROWS, 1, dtype=torch.long)], 1)
        lp = naive_log_probs(full_forward(model, tokens), labels)
    return weights, lp


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))
