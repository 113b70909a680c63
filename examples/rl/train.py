"""The main job: GRPO on the digit task with megatron-core, rollouts from an SGLang-protocol engine,
and the slime_tis correction injected through its public Megatron hook.

Single process::

    python -m examples.rl.train --run-dir runs/alg2 --use-tis            # algorithm 2 (decoupled PPO + TIS)

Two processes (pipeline parallel 2, or data parallel 2 with ``--pp 1``)::

    torchrun --nproc-per-node 2 -m examples.rl.train --pp 2 --run-dir runs/pp2 --use-tis

The algorithm is chosen by the plugin's flags only: none = 0 (PPO), ``--use-rollout-log-probs`` = 1,
``--use-tis`` = 2, both = 3; ``--tis-mode/--tis-level/...`` as documented in docs/reference.md.
Everything the correction does happens inside ``tis_forward_backward_func`` (the "two-line change").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

import torch

from examples.rl.quant import ENGINE_QUANT_CHOICES
from examples.rl.task import EOS, TRANSFORMS, DigitTask

DEFAULT_RUN_DIR = "runs/example"


def build_parser() -> argparse.ArgumentParser:
    from slime_tis.arguments import add_tis_arguments

    p = argparse.ArgumentParser(
        prog="python -m examples.rl.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("run")
    g.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="logs, checkpoints and dumps go here")
    g.add_argument(
        "--steps",
        type=int,
        default=50,
        help="number of RL steps (rollouts; steps-per-rollout x ppo-epochs optimizer steps each)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-interval", type=int, default=0, help="checkpoint every N steps (0 = only at the end)")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from RUN_DIR's latest checkpoint with the run's saved configuration (RUN_DIR/args.json: "
        "flags not given keep their saved value; a contradicting flag is refused; --steps, --save-interval, "
        "--dump-interval, --pp, --sglang-url may change)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start anew in a non-empty run directory of this job: delete its contents first (without it, a "
        "non-empty RUN_DIR is refused unless --resume)",
    )
    g.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")
    g.add_argument(
        "--dump-interval",
        type=int,
        default=5,
        help="write rollout/training log-probs to RUN_DIR/logprobs.jsonl every N steps (0 = never)",
    )
    g = p.add_argument_group("task and model")
    g.add_argument("--num-digits", type=int, default=3)
    g.add_argument("--transform", choices=TRANSFORMS, default="reverse")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-heads", type=int, default=4)
    g.add_argument("--vocab-size", type=int, default=16,
                   help="the model's vocabulary (the task uses ids 0-15; more ids are ones the policy may emit)")
    g.add_argument(
        "--moe-experts",
        type=int,
        default=0,
        help="mixture of experts: every block's MLP becomes E experts behind a top-k router (megatron-core MoE "
        "layer; 0 = the dense GPT-2 MLP)",
    )
    g.add_argument("--moe-topk", type=int, default=2, help="experts per token (with --moe-experts)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--prompts-per-step", type=int, default=32)
    g.add_argument("--group-size", type=int, default=8, help="responses per prompt (GRPO group)")
    g.add_argument("--num-microbatches", type=int, default=2, help="micro-batches per step and DP rank")
    g.add_argument(
        "--steps-per-rollout",
        type=int,
        default=1,
        help="optimizer steps the rollout's global batch is split into (slime's --num-steps-per-rollout); "
        "pi_old is computed once per rollout, before the first of them",
    )
    g.add_argument(
        "--ppo-epochs", type=int, default=1, help="passes over each rollout (each of steps-per-rollout steps)"
    )
    g.add_argument("--no-adv-std-normalize", action="store_true", help="GRPO advantages without std scaling")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (the rest of the world is DP)")
    g = p.add_argument_group("rollout")
    g.add_argument(
        "--sglang-url",
        default=None,
        help="send /generate to this SGLang server instead of the embedded engine; weights are "
        "pushed via /update_weights_from_disk from RUN_DIR/engine_weights",
    )
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0,
                   help="nucleus sampling; with top-p < 1 or top-k the engine also returns each token's support "
                   "(SGLang's return_sampling_mask), pi_rollout is the truncated distribution's log-prob, and the "
                   "trainer replays the support unless --tis-sampling-support full")
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-lag", type=int, default=0, help="sample from the policy of k steps ago")
    g.add_argument(
        "--engine-dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="embedded engine decode dtype (bfloat16 = the default training/inference mismatch)",
    )
    g.add_argument(
        "--engine-quant",
        choices=ENGINE_QUANT_CHOICES,
        default="none",
        help="embedded engine: weight-only quantized linear layers (int8 / fp8 per output channel, "
        "fp8-tensor per tensor), dequantized into the decode dtype; training stays float32",
    )
    g.add_argument(
        "--engine-lm-head-fp32",
        action="store_true",
        help="embedded engine: LM head (output matmul and logits) in float32",
    )
    g.add_argument(
        "--rollout-logit-noise",
        type=float,
        default=0.0,
        help="embedded engine: Gaussian noise std added to decode logits (stronger mismatch)",
    )
    g.add_argument(
        "--routing-replay",
        action="store_true",
        help="MoE rollout routing replay: training uses the experts the engine chose per token (returned as "
        "SGLang's return_routed_experts) instead of its own router's top-k",
    )
    add_tis_arguments(p)
    return p


def truncates(top_p: float, top_k: int, vocab_size: int) -> bool:
    """Whether the rollout samples from a truncated distribution (then the engine returns the supports)."""
    return top_p < 1.0 or 0 < top_k < vocab_size


def with_support(tis: Any, rows: Any, device: torch.device) -> Any:
    """``tis`` (a ``TISBatch``) carrying the sampling supports of the micro-batch ``rows`` when the rollout has them
    (CP-local CSR: ``engine.support_logprobs.padded_support``)."""
    if rows.support_lengths is None:
        return tis
    import dataclasses

    from examples.rl.batch import support_csr
    from slime_tis.engine.support_logprobs import padded_support

    ids, offsets = padded_support(*support_csr(rows), tuple(rows.labels.shape))
    return dataclasses.replace(tis, support_ids=ids.to(device), support_offsets=offsets.to(device))


def validate(args: argparse.Namespace, world_size: int) -> None:
    positive = ("steps", "prompts_per_step", "group_size", "num_microbatches", "pp", "steps_per_rollout", "ppo_epochs")
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("save_interval", "dump_interval", "rollout_lag", "rollout_logit_noise", "moe_experts"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.vocab_size < 16:
        raise ValueError(f"--vocab-size must be >= 16 (the task's ids), got {args.vocab_size}")
    if getattr(args, "tis_sampling_support", None) == "replay" and not truncates(
            args.rollout_top_p, args.rollout_top_k, args.vocab_size):
        raise ValueError(f"--tis-sampling-support replay replays the support a truncated rollout sampled from, but "
                         f"--rollout-top-p {args.rollout_top_p} and --rollout-top-k {args.rollout_top_k} keep the "
                         f"whole vocabulary of {args.vocab_size}: set --rollout-top-p < 1 or --rollout-top-k")
    if args.rollout_temperature <= 0:
        raise ValueError(f"--rollout-temperature must be > 0, got {args.rollout_temperature}")
    if args.moe_experts and not 1 <= args.moe_topk <= args.moe_experts:
        raise ValueError(f"--moe-topk must be in [1, --moe-experts={args.moe_experts}], got {args.moe_topk}")
    if args.routing_replay and not args.moe_experts:
        raise ValueError("--routing-replay replays the engine's expert choices: it needs --moe-experts > 0")
    dp = world_size // args.pp
    n = args.prompts_per_step * args.group_size
    if n % (dp * args.num_microbatches * args.steps_per_rollout):
        raise ValueError(
            f"prompts-per-step x group-size = {n} sequences must be divisible by DP size ({dp}) x "
            f"--num-microbatches ({args.num_microbatches}) x --steps-per-rollout ({args.steps_per_rollout})"
        )
    embedded_only = (
        args.engine_dtype != "bfloat16",
        args.rollout_logit_noise,
        args.engine_quant != "none",
        args.engine_lm_head_fp32,
    )
    if args.sglang_url and any(embedded_only):
        raise ValueError(
            "--engine-dtype / --engine-quant / --engine-lm-head-fp32 / --rollout-logit-noise configure the "
            "embedded engine; "
            "with --sglang-url configure the server instead"
        )


def resolve_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` under the run directory's rules (``examples.rl.run_dir``): a fresh run needs an empty
    RUN_DIR (or ``--overwrite``); ``--resume`` takes the saved configuration and refuses contradicting
    flags. Read-only: every rank calls it before any rank writes."""
    from examples.rl import checkpoint, run_dir
    from slime_tis import TISConfig

    args = build_parser().parse_args(argv)
    checkpoint.check_reader_compatible()  # a torch the example cannot run refuses here, before anything is built
    if args.resume and args.overwrite:
        raise run_dir.RunDirError("--resume continues the run in RUN_DIR, --overwrite deletes it: give one of them")
    if not args.resume:
        run_dir.check_fresh(args.run_dir, overwrite=args.overwrite)
        return args
    saved = run_dir.load_saved(args.run_dir)
    args = run_dir.resolve_resume(args, run_dir.explicit_dests(build_parser, argv), saved, TISConfig.from_args)
    step = checkpoint.latest_step(args.run_dir)  # a damaged checkpoints/latest: refused naming it
    if step is None:
        raise run_dir.RunDirError(f"--resume given but {args.run_dir}/checkpoints/latest does not exist")
    checkpoint.check_complete(args.run_dir, step)  # a corrupt checkpoint: refused before the model is built
    return args


def _refusals() -> tuple[type[Exception], ...]:
    """The errors that refuse the user's input or files (one line, exit status 2, no traceback)."""
    from examples.rl.checkpoint import UnsupportedTorchError
    from examples.rl.ckpt_manifest import CheckpointIntegrityError
    from examples.rl.run_dir import RunDirError

    return RunDirError, CheckpointIntegrityError, UnsupportedTorchError


def _refuse(e: BaseException, rank: int | None = None) -> int:
    where = "" if rank is None else f" (rank {rank})"
    print(f"examples.rl.train: error{where}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    refusals = _refusals()
    try:
        args = resolve_args(list(sys.argv[1:] if argv is None else argv))
    except refusals as e:
        return _refuse(e)
    from examples.rl.dist import init_distributed, shutdown

    info = init_distributed(pp=args.pp, seed=args.seed)
    rank = info.rank if info.world_size > 1 else None
    try:
        try:
            validate(args, info.world_size)
        except ValueError as e:  # the same on every rank (configuration and world size only)
            return _refuse(e, rank)
        if args.overwrite and info.rank == 0 and os.path.isdir(args.run_dir):
            from examples.rl.run_dir import clear

            clear(args.run_dir)  # every rank has checked the directory (resolve_args) before this
        if info.world_size > 1:
            torch.distributed.barrier()
        Trainer(args, info).run()
    except refusals as e:  # a checkpoint damaged after the start-up check: every rank reads the same files
        return _refuse(e, rank)
    except Exception as e:
        from slime_tis.megatron.rank_failure import RankFailedError, explain

        # outside the hook's calls (the example's own collectives): the rank that failed first, when one said so
        other = None if isinstance(e, RankFailedError) else explain(e, "the example's training loop")
        if other is None:
            raise
        raise other from e
    finally:
        shutdown()
    return 0


class Trainer:
    """Wires task, model, optimizer, rollout backend, hook, logging and checkpoints together."""

    def __init__(self, args: argparse.Namespace, info: Any) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from examples.rl.model import ModelConfig, build_megatron_gpt
        from slime_tis import TISConfig
        from slime_tis.megatron import tis_forward_backward_func

        self.args, self.info = args, info
        self.task = DigitTask(num_digits=args.num_digits, transform=args.transform)
        self.mcfg = ModelConfig(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_heads=args.num_heads,
            vocab_size=args.vocab_size,
            max_seq_len=max(16, self.task.max_seq_len),
            moe_experts=args.moe_experts,
            moe_topk=args.moe_topk if args.moe_experts else 0,
        )
        self.tis_cfg = TISConfig.from_args(args)
        self.layout = {"world_size": info.world_size, "pp": args.pp}

        torch.manual_seed(args.seed)
        model = build_megatron_gpt(self.mcfg, pp=args.pp).to(info.device)
        tcfg = model.config
        self.model = DistributedDataParallel(
            config=tcfg,
            module=model,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
        )
        tcfg.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=args.lr,
                weight_decay=0.0,
                clip_grad=args.clip_grad,
                adam_beta1=0.9,
                adam_beta2=0.99,
                use_distributed_optimizer=False,
            ),
            [self.model],
        )
        # ---- the plugin: one line wraps megatron's schedule (flags were added in build_parser) ----
        # MoE: the hook replays the engine's experts (--routing-replay) and counts the routing mismatch, from
        # each micro-batch's item["routing"] (slime_tis.megatron.RoutingBatch)
        self.forward_backward = tis_forward_backward_func(
            get_forward_backward_func(),
            self.tis_cfg,
            temperature=args.rollout_temperature,
            routing_replay=args.routing_replay,
            routing_metrics=self.mcfg.is_moe,
        )
        self.backend, self.sync = self._make_rollout_backend() if info.is_engine_rank else (None, None)

    # ------------------------------------------------------------------ rollout side (engine rank)
    def _make_rollout_backend(self) -> tuple[Any, Any]:
        from examples.rl.http_client import SGLangClient
        from examples.rl.rollout_engine import EmbeddedEngine
        from examples.rl.weight_sync import DiskWeightSync, InProcessWeightSync, LaggedWeightSync

        a = self.args
        if a.sglang_url:
            client = SGLangClient(a.sglang_url, api_key=os.environ.get("SGLANG_API_KEY") or None)
            client.wait_healthy()
            inner = DiskWeightSync(client, os.path.join(a.run_dir, "engine_weights"), self.mcfg, EOS)
            return client, LaggedWeightSync(inner, a.rollout_lag)
        engine = EmbeddedEngine(
            self.mcfg,
            dtype=getattr(torch, a.engine_dtype),
            logit_noise=a.rollout_logit_noise,
            device=self.info.device,
            quant=a.engine_quant,
            lm_head_fp32=a.engine_lm_head_fp32,
        )
        return engine, LaggedWeightSync(InProcessWeightSync(engine), a.rollout_lag)

    def _push_weights(self, step: int) -> None:
        from examples.rl.model import gather_gpt2_weights

        weights = gather_gpt2_weights(self.model, self.mcfg)  # collective over the PP group
        if self.sync is not None:
            self.sync.push(weights, step)

    def _rollout(self, step: int) -> Any:
        """Engine rank collects the batch; every rank receives it (broadcast from global rank 0)."""
        from examples.rl.batch import RolloutBatch
        from examples.rl.rollout import RolloutSettings, collect_rollout

        a = self.args
        payload = [None]
        if self.info.is_engine_rank:
            settings = RolloutSettings(
                a.prompts_per_step,
                a.group_size,
                a.rollout_temperature,
                a.rollout_top_p,
                a.rollout_top_k,
                a.seed,
                not a.no_adv_std_normalize,
                (self.mcfg.num_layers, self.mcfg.moe_topk, self.mcfg.moe_experts) if self.mcfg.is_moe else None,
                self.mcfg.vocab_size if truncates(a.rollout_top_p, a.rollout_top_k, self.mcfg.vocab_size) else None,
            )
            payload = [collect_rollout(self.backend, self.task, settings, step).to_payload()]
        if self.info.world_size > 1:
            torch.distributed.broadcast_object_list(payload, src=0)
        return RolloutBatch.from_payload(payload[0])

    # ------------------------------------------------------------------ training side
    def _with_staleness(self, step: int, tis: Any) -> Any:
        """``tis`` carrying each sequence's staleness where the correction reads it (``--tis-staleness-buckets`` /
        ``--tis-staleness-bound-decay``): at rollout ``step`` the engine samples with the weights pushed
        ``min(step, --rollout-lag)`` steps ago (``LaggedWeightSync``), so every sequence is that many policy versions
        behind the trainer's."""
        if self.tis_cfg.staleness_buckets is None and self.tis_cfg.staleness_decay is None:
            return tis
        import dataclasses

        lag = torch.full((tis.num_sequences,), float(min(step, self.args.rollout_lag)), device=tis.labels.device)
        return dataclasses.replace(tis, staleness=lag)

    def _micro_batches(self, batch: Any, step: int) -> tuple[list[dict[str, Any]], int]:
        from slime_tis.megatron import RoutingBatch, TISBatch

        n, seq = batch.tokens.shape
        shard = n // self.info.dp_size
        mbs = shard // self.args.num_microbatches
        dev = self.info.device
        pos = torch.arange(seq, device=dev).view(1, -1)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=dev), 1).view(1, 1, seq, seq)
        items = []
        for m in range(self.args.num_microbatches):
            lo = self.info.dp_rank * shard + m * mbs
            mb = batch.rows(lo, lo + mbs)
            items.append(
                {
                    "tokens": mb.tokens.to(dev),
                    "position_ids": pos.expand(mbs, seq),
                    "attention_mask": causal,
                    "tis": self._with_staleness(step, with_support(TISBatch.from_padded(
                        mb.labels.to(dev),
                        mb.loss_mask.to(dev),
                        mb.advantages.to(dev),
                        mb.rollout_log_probs.to(dev),
                    ), mb, dev)),
                    "rows": mb,
                    "routing": None
                    if mb.routed_experts is None
                    else RoutingBatch(mb.routed_experts, mb.loss_mask),
                }
            )
        return items, mbs

    def _forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, None]:
        item = next(data_iterator)
        return model(item["tokens"], item["position_ids"], item["attention_mask"]), None

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self._rollout(step)
        t_rollout = time.perf_counter() - t0
        from slime_tis.megatron import rollout_step_iterator

        n_steps, n_mb, seq = self.args.steps_per_rollout, self.args.num_microbatches, batch.tokens.shape[1]
        per_step = batch.num_sequences // n_steps  # optimizer step s trains on sequences [s*per_step, (s+1)*per_step)
        items = []
        for s in range(n_steps):
            step_items, mbs = self._micro_batches(batch.rows(s * per_step, (s + 1) * per_step), step)
            items += step_items
        dump = self._dump_now(step)
        extra_lp = self._recompute_for_dump(items, mbs, seq) if dump else None
        if self.tis_cfg.needs_old_log_probs:  # pi_old once per rollout, before its first optimizer step
            items = self.forward_backward.compute_old_log_probs(
                forward_step_func=self._forward_step,
                data_iterator=items,
                model=[self.model],
                num_microbatches=n_mb,
                num_steps=n_steps,
                seq_length=seq,
                micro_batch_size=mbs,
            )
        all_ok = True
        routing: dict[str, Any] = {}  # MoE: the routing metrics of the rollout's first optimizer step
        for epoch in range(self.args.ppo_epochs):
            for s in range(n_steps):
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                self.forward_backward(
                    forward_step_func=self._forward_step,
                    data_iterator=rollout_step_iterator(items, s, n_mb),
                    model=[self.model],
                    num_microbatches=n_mb,
                    seq_length=seq,
                    micro_batch_size=mbs,
                    forward_only=False,
                )
                if epoch == 0 and s == 0:  # at the parameters the rollout was sampled with
                    routing = {k: v for k, v in self.forward_backward.last_metrics.items() if k.startswith("moe/")}
                ok, grad_norm, _ = self.optimizer.step()
                all_ok = all_ok and ok
        ok = all_ok  # the metrics below are those of the rollout's last optimizer step
        metrics = {k: float(v) for k, v in {**self.forward_backward.last_metrics, **routing}.items()}  # host-sync-ok
        if dump:
            self._dump(step, items, extra_lp)
        self._push_weights(step + 1)
        metrics.update(
            {
                "reward": float(batch.rewards.mean()),  # host-sync-ok (logging)
                "reward_std": float(batch.rewards.std()),  # host-sync-ok
                "response_len": float(batch.response_lengths.float().mean()),  # host-sync-ok
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "update_skipped": float(not ok),
                "rollout_time_s": t_rollout,
                "step_time_s": time.perf_counter() - t0,
            }
        )
        return metrics

    def _sampling_support(self) -> str:
        """Over what the trainer's log-probs are taken: ``replay`` when the rollout carries supports and
        ``--tis-sampling-support`` is not ``full``, else ``full``."""
        a = self.args
        carried = truncates(a.rollout_top_p, a.rollout_top_k, self.mcfg.vocab_size)
        return "replay" if carried and self.tis_cfg.sampling_support != "full" else "full"

    def _dump_now(self, step: int) -> bool:
        k = self.args.dump_interval
        return k > 0 and (step % k == 0 or step == self.args.steps - 1)

    def _recompute_for_dump(self, items: list[dict[str, Any]], mbs: int, seq: int) -> list[torch.Tensor] | None:
        """Algorithms 1 and 3 skip the old-log-prob pass; for a dump step run the plugin's forward-only
        recompute so the dump holds the trainer's log-probs at this step's parameters (= pi_old)."""
        if self.tis_cfg.needs_old_log_probs:
            return None  # the hook fills TISBatch.old_log_probs itself
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from slime_tis.megatron.recompute import recompute_log_probs

        last = ps.is_pipeline_last_stage()
        routing = self.forward_backward.routing  # MoE: the same routing as the hook's passes (replay or not)
        with contextlib.ExitStack() as stack:
            step = self._forward_step
            if routing is not None:
                step = stack.enter_context(routing.active(step, training=False))
            return recompute_log_probs(
                get_forward_backward_func(),
                step,
                items,
                [self.model],
                batches=[it["tis"] for it in items] if last else None,
                num_microbatches=len(items),
                vpp=False,
                temperature=self.args.rollout_temperature,
                seq_length=seq,
                micro_batch_size=mbs,
            )

    def _dump(self, step: int, items: list[dict[str, Any]], extra_lp: list[torch.Tensor] | None) -> None:
        """Append this step's rollout and training (lp_old) log-probs to RUN_DIR/logprobs.jsonl
        (gathered over DP onto the logging rank); the file is ``slime-tis diagnose`` input."""
        from megatron.core import parallel_state as ps

        from slime_tis.tools.dump import write_logprob_dump

        if not ps.is_pipeline_last_stage():
            return
        records = []
        for k, it in enumerate(items):
            rows = it["rows"]
            lp_old = it["tis"].old_log_probs if extra_lp is None else extra_lp[k]
            if lp_old is None:
                return
            lp_old = lp_old.detach().float().cpu().view(rows.tokens.shape)
            for i in range(rows.tokens.shape[0]):  # per-sequence records (host data, dump only)
                m = rows.loss_mask[i]
                records.append(
                    {
                        "train_log_probs": lp_old[i][m].tolist(),
                        "rollout_log_probs": rows.rollout_log_probs[i][m].tolist(),
                        "token_ids": rows.labels[i][m].tolist(),
                        "reward": float(rows.rewards[i]),
                        "step": step,
                        **({"rollout_log_mass": rows.rollout_log_mass[i][m].tolist()}
                           if rows.rollout_log_mass is not None else {}),
                        # the engine serves the weights pushed min(step, lag) steps ago (LaggedWeightSync)
                        **({"staleness": float(min(step, self.args.rollout_lag))} if self.args.rollout_lag else {}),
                    }
                )
        gathered: list[Any] = [None] * self.info.dp_size
        if self.info.dp_size > 1:
            torch.distributed.all_gather_object(gathered, records, group=ps.get_data_parallel_group())
        else:
            gathered = [records]
        if self.info.is_logging_rank:
            flat = [r for part in gathered for r in part]
            for j, r in enumerate(flat):
                r["sample_index"] = j
            write_logprob_dump(
                os.path.join(self.args.run_dir, "logprobs.jsonl"),
                flat,
                append=True,
                meta={
                    "train_policy": "old",
                    "algorithm": self.tis_cfg.algorithm,
                    "temperature": self.args.rollout_temperature,
                    "writer": "examples.rl.train",
                    "sampling_support": self._sampling_support(),
                },
            )

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        from examples.rl import checkpoint
        from examples.rl.run_dir import cut_from_step, write_saved
        from examples.rl.run_log import RunLogger

        a, info = self.args, self.info
        start = 0
        if a.resume:
            found = checkpoint.latest_step(a.run_dir)
            if found is None:
                raise FileNotFoundError(f"--resume given but {a.run_dir}/checkpoints/latest does not exist")
            extra = checkpoint.load(a.run_dir, found, self.model, self.optimizer, load_extra=self.sync is not None)
            start = found
        if info.is_logging_rank or info.is_engine_rank:
            os.makedirs(a.run_dir, exist_ok=True)
        if info.rank == 0:
            print(self.tis_cfg.describe(), flush=True)
            if not a.resume:  # a resumed run keeps the args.json of its first start
                write_saved(a.run_dir, a, {"algorithm": self.tis_cfg.algorithm, "world_size": info.world_size})
        if a.resume and info.is_logging_rank:  # the dump loses the steps that will be repeated
            for note in cut_from_step(os.path.join(a.run_dir, "logprobs.jsonl"), start):
                print(f"resume: {note}; cut", flush=True)
        if a.resume and self.sync is not None:
            self.sync.load_state_dict(extra["lag"], start)
        elif not a.resume:
            self._push_weights(0)
        log = RunLogger(
            a.run_dir,
            enabled=info.is_logging_rank,
            total_steps=a.steps,
            start_step=start,
            progress=not a.no_progress,
        )
        try:
            for step in range(start, a.steps):
                metrics = self.train_step(step)
                log.log(step, metrics)
                done = step + 1
                if (a.save_interval and done % a.save_interval == 0) or done == a.steps:
                    extra = {"lag": self.sync.state_dict()} if self.sync is not None else None
                    checkpoint.save(a.run_dir, done, self.model, self.optimizer, self.layout, extra)
        finally:
            log.close()


if __name__ == "__main__":
    raise SystemExit(main())
