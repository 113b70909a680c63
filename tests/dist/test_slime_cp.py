"""slime hooks under 2-rank context parallelism (real torchrun processes, gloo, megatron parallel_state).

Every rank gets slime's calling convention (per-sample lists of CP-local zigzag chunks, full-length
loss masks, an args namespace) for the same global micro-batch, runs the hook, and the per-rank results
put back together must equal the core on the unsplit batch (computed on every rank, no communication):

* TIS hook: per-token loss, returned full-length masks (identical on both ranks), token metrics, slime's
  per-sample-mean loss summed over CP ranks, and the exact ``MetricStats`` path reduced over DP x CP;
* REINFORCE + IS custom loss: the loss summed over CP ranks and the gradient of the per-sample logits, also
  with slime's ``--use-opsm`` (slime's mask rule, on full-length log-probs gathered over CP), ``--use-unbiased-kl``
  and a custom pg-loss reducer (CP-local, as slime hands it), and with ``--allgather-cp`` (slime's contiguous
  chunks of the concatenated micro-batch, padded to a multiple of CP);
* rollout-data hook: the global batch-normalisation factor, and the dump (full responses);
* then, re-initialised as DP = 2: ``keep`` with rollouts whose samples lie on different DP ranks and ``drop``
  with one-sample rollouts, the DP-summed loss equals the rollout means; ``drop`` with a rollout of several
  samples on one rank is refused on both ranks.

The batch has a sample whose response lies entirely on CP rank 0 (rank 1 must still join every
collective for it), one-token responses, tool tokens, NaN/inf traps and a catastrophic token; its six
samples form four rollouts (two of them agentic, several samples each; six one-sample rollouts for ``drop``), so
``keep`` / ``drop`` are checked against slime's per-rollout reducer (``rollout_mask_sums``) and the rollout means
of tests/_slime_oracle.py.

Run directly: ``python -m torch.distributed.run --nproc-per-node 2 tests/dist/test_slime_cp.py --out DIR``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from _launch import torchrun

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_slime_hooks_cp2(tmp_path):
    torchrun(HERE, ["--out", str(tmp_path)], timeout=280, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["checks"], res
        bad = {k: v for k, v in res["checks"].items() if not (v <= 2e-5)}
        assert not bad, f"rank {rank}: errors above tolerance: {bad}"
        assert res["rank1_local_tokens_of_sample1"] == 0


# ------------------------------------------------------------------------------------------ worker
def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from _cpu import cpu_shim  # noqa: F401  (megatron on a CPU-only torch)
    from _slime_oracle import args_ns, make_batch, owner_layout, rollout_mean, slime_sum_of_sample_mean
    from megatron.core import parallel_state as ps

    from slime_tis import TISConfig, compute_tis
    from slime_tis.core import LocalReducer, normalisation_factor
    from slime_tis.slime import (
        COLLECTOR,
        compute_tis_for_slime,
        postprocess_rollout_data,
        reinforce_is_loss,
        tis_config_from_slime_args,
        token_metrics,
    )
    from slime_tis.slime.state import STATE
    from slime_tis.tools.dump import read_logprob_dump

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(context_parallel_size=2)
    cp_rank, cp = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    assert cp == 2
    b = make_batch(21, vocab=13)
    agentic = [0, 0, 1, 2, 2, 3]  # rollouts 0 and 2 have two samples; sample 1 lies on CP rank 0 only
    b.rollout_ids = agentic
    checks: dict[str, float] = {}

    def use_rollouts(kw: dict) -> None:
        """``drop`` needs one-sample rollouts."""
        b.rollout_ids = None if kw.get("tis_rejected_denominator") == "drop" else agentic

    def err(a: torch.Tensor, e: torch.Tensor) -> float:
        a, e = a.double(), e.double()
        same = (a == e) | (torch.isnan(a) & torch.isnan(e))  # equal values, infinities and NaNs
        d = torch.where(same, torch.zeros_like(a), (a - e).abs())
        if not torch.isfinite(d).all():
            return float("inf")
        scale = torch.where(torch.isfinite(e), e.abs(), torch.zeros_like(e)).max().clamp(min=1.0)
        return float(d.max() / scale) if d.numel() else 0.0

    def cp_sum(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().clone().double()
        dist.all_reduce(x, group=ps.get_context_parallel_group())
        return x

    def full_core(cfg: TISConfig, **kw):
        return compute_tis(cfg, b.packed("train"), b.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                           reducer=LocalReducer(), **kw)

    # ---------------------------------------------------------------- TIS hook
    tis_cases = {
        "a2_tok_trunc": dict(use_tis=True, tis_mode="truncate", tis_level="token", tis_upper_bound=1.3),
        "a2_seq_clip_veto": dict(use_tis=True, tis_mode="clip", tis_level="sequence", tis_upper_bound=3.0,
                                 tis_veto_threshold=1e-3),
        "a2_geo_mask_rs_drop": dict(use_tis=True, get_mismatch_metrics=True, tis_mode="mask", tis_level="geometric",
                                    tis_upper_bound=1.15,
                                    tis_rs_level="sequence", tis_rs_upper_bound=5.0,
                                    tis_rejected_denominator="drop"),
        "a1_geo_mask": dict(use_rollout_logprobs=True, get_mismatch_metrics=True, tis_mode="mask",
                            tis_level="geometric", tis_upper_bound=1.2),
        "a0_metrics": dict(get_mismatch_metrics=True),
    }
    train_local = b.local("train", cp_rank, cp)  # pi_old, the same tensor objects for both hooks
    for name, kw in tis_cases.items():
        use_rollouts(kw)
        args = args_ns(**kw)
        cfg = tis_config_from_slime_args(args)
        postprocess_rollout_data(args, 0, b.rollout_data() | {
            "log_probs": train_local, "rollout_log_probs": b.local("rollout", cp_rank, cp)})
        pg_local = b.local_flat("pg_loss", cp_rank, cp)
        new, masks, metrics = compute_tis_for_slime(
            args, pg_loss=pg_local, train_log_probs=train_local,
            rollout_log_probs=b.local("rollout", cp_rank, cp), loss_masks=b.masks, total_lengths=b.total_lengths,
            response_lengths=b.response_lengths)
        ref = full_core(cfg, extra_finite=(b.packed("pg_loss"),) if cfg.algorithm else ())
        if cfg.algorithm == 0:
            exp_new, exp_masks = b.packed("pg_loss"), b.packed("masks")
        else:
            w = ref.weights if cfg.applies_weights else torch.ones_like(ref.weights)
            exp_new = torch.where(ref.keep_mask, b.packed("pg_loss") * w, torch.zeros(()))
            if cfg.rejected_denominator == "drop":  # per sample: valid / kept tokens
                sid = ref.ratios.seq_id
                valid = torch.zeros(len(b.masks)).index_add_(0, sid, (b.packed("masks") != 0).float())
                kept = torch.zeros(len(b.masks)).index_add_(0, sid, ref.keep_mask.float())
                exp_new = exp_new * (valid / kept.clamp(min=1))[sid]
            exp_masks = b.packed("masks") * ref.keep_mask
        full_new = cp_sum(b.scatter_local(torch.nan_to_num(new, nan=0.0), cp_rank, cp))
        checks[f"{name}/pg_loss"] = err(full_new, torch.nan_to_num(exp_new, nan=0.0))
        checks[f"{name}/masks"] = err(torch.cat(masks).double(), exp_masks.double())
        other = torch.cat(masks).double().clone()
        dist.all_reduce(other, group=ps.get_context_parallel_group())
        checks[f"{name}/masks_same_on_ranks"] = err(other, 2 * torch.cat(masks).double())
        ref_metrics = token_metrics(cfg, ref)
        for key, value in metrics.items():
            checks[f"{name}/{key}"] = err(cp_sum(b.scatter_local(value, cp_rank, cp)), ref_metrics[key])
        loss_cp = cp_sum(slime_sum_of_sample_mean(torch.nan_to_num(new, nan=0.0), b, masks, cp_rank, cp))
        loss_1 = slime_sum_of_sample_mean(torch.nan_to_num(exp_new, nan=0.0), b, list(exp_masks.split(
            b.response_lengths)), 0, 1)
        checks[f"{name}/slime_loss"] = err(loss_cp, loss_1)
        if cfg.algorithm:
            w = ref.weights if cfg.applies_weights else torch.ones_like(ref.weights)
            checks[f"{name}/rollout_mean"] = err(loss_cp, rollout_mean(
                b.packed("pg_loss") * w, ref.keep_mask, b, cfg.rejected_denominator).double())
        exact = COLLECTOR.flush()
        ref_exact = {k: float(v) for k, v in ref.stats.finalize().items()}
        checks[f"{name}/exact_metric_keys"] = 0.0 if set(exact) == set(ref_exact) else float("inf")
        for key, value in ref_exact.items():
            checks[f"{name}/exact/{key}"] = err(torch.tensor(exact.get(key, float("nan"))), torch.tensor(value))

    # ---------------------------------------------------------------- algorithm 3 custom loss
    vocab, temp = 13, 0.9
    gen = torch.Generator().manual_seed(5)
    sample_logits = [torch.randn(t, vocab, generator=gen).requires_grad_(True) for t in b.total_lengths]
    local_rows = []
    for lg, t in zip(sample_logits, b.total_lengths):
        c = -(-t // (2 * cp))
        padded = torch.cat([lg, torch.zeros(2 * cp * c - t, vocab)])
        local_rows += [padded[k * c:(k + 1) * c] for k in (cp_rank, 2 * cp - 1 - cp_rank)]
    local_logits = torch.cat(local_rows + [torch.zeros(3, vocab)])[None]  # slime pads the packed batch
    # --allgather-cp: the samples back to back, padded to a multiple of cp, contiguous chunk cp_rank
    stream = torch.cat(sample_logits)
    stream = torch.cat([stream, torch.zeros(-stream.shape[0] % (2 * cp) + 2 * cp, vocab)])
    allgather_logits = stream.chunk(cp)[cp_rank][None]
    loss_cases = {
        "a3_seq_trunc": dict(tis_mode="truncate", tis_level="sequence", tis_upper_bound=1.5),
        "a3_geo_mask_veto_bn": dict(tis_mode="mask", tis_level="geometric", tis_upper_bound=1.3,
                                    tis_veto_threshold=1e-3, tis_batch_normalize=True),
        "a3_tok_clip_drop": dict(tis_mode="clip", tis_level="token", tis_upper_bound=1.4,
                                 tis_rejected_denominator="drop"),
        "a3_tok_mask_drop": dict(tis_mode="mask", tis_level="token", tis_upper_bound=3.0,
                                 tis_rejected_denominator="drop"),
        "a3_seq_trunc_allgather": dict(tis_mode="truncate", tis_level="sequence", tis_upper_bound=1.5,
                                       allgather_cp=True),
        "a3_tok_mask_drop_allgather": dict(tis_mode="mask", tis_level="token", tis_upper_bound=3.0,
                                           tis_rejected_denominator="drop", allgather_cp=True),
    }
    def policy_log_probs(logits_list):
        out = []
        for lg, t, r, toks in zip(logits_list, b.total_lengths, b.response_lengths, b.tokens):
            p = t - r
            out.append(torch.log_softmax(lg[p - 1:t - 1] / temp, -1).gather(-1, toks[p:, None]).squeeze(-1))
        return out

    # rollout log-probs near the policy (make_batch's offsets, NaN and catastrophic-token traps kept)
    b3 = dataclasses.replace(b, rollout=[lp.detach() + (r - t) for lp, r, t in
                                         zip(policy_log_probs(sample_logits), b.rollout, b.train)])
    batch = {"unconcat_tokens": b.tokens, "total_lengths": b.total_lengths, "response_lengths": b.response_lengths,
             "loss_masks": b.masks, "advantages": b.local("advantages", cp_rank, cp),
             "rollout_log_probs": b3.local("rollout", cp_rank, cp), "rollout_mask_sums": b.rollout_mask_sums()}
    # slime's pi_old (--get-mismatch-metrics): the policy's log-probs
    pi_old = dataclasses.replace(b, train=[lp.detach() for lp in policy_log_probs(sample_logits)])
    data3 = b.rollout_data() | {"log_probs": pi_old.local("train", cp_rank, cp), "advantages": batch["advantages"],
                                "rollout_log_probs": batch["rollout_log_probs"]}
    for name, kw in loss_cases.items():
        use_rollouts(kw)
        batch["rollout_mask_sums"] = b.rollout_mask_sums()
        args = args_ns(use_rollout_logprobs=True, get_mismatch_metrics=True, rollout_temperature=temp,
                       loss_type="custom_loss", custom_loss_function_path="slime_tis.slime.reinforce_is_loss", **kw)
        postprocess_rollout_data(args, 0, data3 | {"rollout_ids": b.rollouts, "rollout_mask_sums": batch[
            "rollout_mask_sums"]})
        for lg in sample_logits:
            lg.grad = None
        loss, _ = reinforce_is_loss(args, batch, allgather_logits if kw.get("allgather_cp") else local_logits,
                                    lambda x: slime_sum_of_sample_mean(x, b, b.masks, cp_rank, cp))
        loss.backward(retain_graph=True)
        grads = torch.cat([lg.grad for lg in sample_logits])
        # oracle: one process, whole batch
        ref_logits = [lg.detach().clone().requires_grad_(True) for lg in sample_logits]
        cfg = tis_config_from_slime_args(args, algorithm=3)
        lp = torch.cat(policy_log_probs(ref_logits))
        tis = compute_tis(cfg, lp.detach(), b3.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                          reducer=LocalReducer(), extra_finite=(b.packed("advantages"),))
        ref_loss = rollout_mean(-tis.weights * b.packed("advantages") * lp, tis.keep_mask, b,
                                cfg.rejected_denominator)
        ref_loss.backward()
        checks[f"{name}/loss"] = err(cp_sum(loss), ref_loss.detach())
        checks[f"{name}/grad"] = err(cp_sum(grads), torch.cat([lg.grad for lg in ref_logits]))
        rejected = [int(((m != 0) & ~k).sum()) for m, k in zip(b.masks, tis.keep_mask.split(b.response_lengths))]
        checks[f"{name}/some_kept"] = 0.0 if 0 < int(tis.keep_mask.sum()) else float("inf")
        if kw.get("tis_mode") == "mask":  # rejections beyond sample 2 (a NaN at a valid token rejects it whole)
            checks[f"{name}/some_rejected"] = 0.0 if sum(rejected) > rejected[2] else float("inf")
        COLLECTOR.flush()
    b.rollout_ids = agentic
    batch["rollout_mask_sums"] = b.rollout_mask_sums()

    # ------------------------------------ custom loss with slime's OPSM, unbiased KL and a custom pg-loss reducer
    import sys
    import types

    from _slime_sim import opsm_keep

    def compute_opsm_mask(args, full_log_probs, full_old_log_probs, advantages, loss_masks):  # slime 624b824's rule
        return opsm_keep(full_log_probs, full_old_log_probs, advantages, loss_masks, args.opsm_delta), torch.zeros(())

    def kept_mean(total_lengths, response_lengths, masks, per_token):  # a user's reducer, CP-local as slime's
        return lambda x: slime_sum_of_sample_mean(x, b, masks, cp_rank, cp, denom_masks=masks)

    for name in ("slime", "slime.utils", "slime.utils.ppo_utils", "cp_reducers"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["slime.utils.ppo_utils"].compute_opsm_mask = compute_opsm_mask
    sys.modules["cp_reducers"].kept_mean = kept_mean
    ref_full = [lp.detach() - 0.2 for lp in policy_log_probs(sample_logits)]
    args = args_ns(use_rollout_logprobs=True, rollout_temperature=temp, loss_type="custom_loss",
                   custom_loss_function_path="slime_tis.slime.reinforce_is_loss", tis_mode="truncate",
                   tis_level="token", tis_upper_bound=1.5, use_opsm=True, opsm_delta=0.01, use_kl_loss=True,
                   kl_loss_coef=0.1, kl_loss_type="k3", use_unbiased_kl=True,
                   custom_pg_loss_reducer_function_path="cp_reducers.kept_mean")
    postprocess_rollout_data(args, 0, data3)
    for lg in sample_logits:
        lg.grad = None
    batch_o = batch | {"ref_log_probs": dataclasses.replace(b, train=ref_full).local("train", cp_rank, cp)}
    loss, _ = reinforce_is_loss(args, batch_o, local_logits,
                                lambda x: slime_sum_of_sample_mean(x, b, b.masks, cp_rank, cp))
    loss.backward()
    grads = torch.cat([lg.grad for lg in sample_logits])
    ref_logits = [lg.detach().clone().requires_grad_(True) for lg in sample_logits]
    lp = torch.cat(policy_log_probs(ref_logits))
    cfg = tis_config_from_slime_args(args, algorithm=3)
    ro, adv = b3.packed("rollout"), b.packed("advantages")
    tis = compute_tis(cfg, lp.detach(), ro, b.packed("masks"), b.cu_seqlens(), reducer=LocalReducer(),
                      extra_finite=(adv,))
    keep, zero = tis.keep_mask, torch.zeros(())
    opsm = opsm_keep(list(lp.detach().split(b.response_lengths)), b3.rollout, b.advantages, b.masks, 0.01)
    lp_k = torch.where(keep, lp, zero)
    keep_masks = [m * k for m, k in zip(b.masks, keep.split(b.response_lengths))]
    pg = slime_sum_of_sample_mean(torch.where(keep, -tis.weights * adv * opsm * lp_k, zero), b, keep_masks, 0, 1,
                                  denom_masks=keep_masks)
    d = lp_k - torch.where(keep, torch.cat(ref_full), zero)
    kl = torch.exp(lp_k - torch.where(keep, ro, zero)) * (torch.exp(-d) - 1 + d)
    ref_loss = pg + 0.1 * slime_sum_of_sample_mean(torch.where(keep, kl, zero), b, b.masks, 0, 1)
    ref_loss.backward()
    checks["a3_opsm_ukl_reducer/loss"] = err(cp_sum(loss), ref_loss.detach())
    checks["a3_opsm_ukl_reducer/grad"] = err(cp_sum(grads), torch.cat([lg.grad for lg in ref_logits]))
    zeroed = ((opsm == 0) & keep).any()
    checks["a3_opsm_ukl_reducer/some_opsm_zeroed"] = 0.0 if zeroed else float("inf")
    COLLECTOR.flush()
    for name in ("slime", "slime.utils", "slime.utils.ppo_utils", "cp_reducers"):
        del sys.modules[name]

    # ---------------------------------------------------------------- rollout-data hook
    dump_dir = out / "dump"
    for level in ("token", "sequence"):
        args = args_ns(use_tis=True, tis_mode="truncate", tis_level=level, tis_upper_bound=1.5,
                       tis_batch_normalize=True, tis_dump_dir=str(dump_dir) if level == "token" else None)
        data = {"log_probs": b.local("train", cp_rank, cp), "rollout_log_probs": b.local("rollout", cp_rank, cp),
                "loss_masks": b.masks, "total_lengths": b.total_lengths, "response_lengths": b.response_lengths}
        postprocess_rollout_data(args, 7, data)
        cfg = tis_config_from_slime_args(args)
        ref = full_core(cfg.replace(batch_normalize=False))
        checks[f"postprocess_{level}/factor"] = err(STATE.batch_norm_factor, normalisation_factor(
            ref.norm_sum, ref.norm_count))
    dist.barrier()
    dump = read_logprob_dump(dump_dir / "logprobs_dp0.jsonl")
    checks["dump/train"] = err(dump.train_log_probs, b.packed("train"))
    checks["dump/rollout"] = err(dump.rollout_log_probs, b.packed("rollout"))
    checks["dump/mask"] = err(dump.loss_mask.double(), (b.packed("masks") != 0).double())

    # ---------------------------------------------------------------- DP = 2: rollouts split across DP ranks
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()  # the same 2 processes as DP = 2, CP = 1
    dp_group = ps.get_data_parallel_group()
    part = [0, 2, 4] if ps.get_data_parallel_rank() == 0 else [1, 3, 5]  # agentic rollouts 0 and 2 span both ranks
    for denominator, rollout_ids in (("keep", agentic), ("drop", None), ("drop", [0, 1, 0, 2, 3, 4])):
        b.rollout_ids = rollout_ids
        mb = b.subset(part)
        data = mb.rollout_data() | {"log_probs": mb.train, "partition": part, "raw_reward": [0.0] * len(b.masks)}
        args = args_ns(use_tis=True, get_mismatch_metrics=True, tis_mode="mask", tis_level="token", tis_upper_bound=1.3,
                       tis_rejected_denominator=denominator)
        cfg = tis_config_from_slime_args(args)
        if denominator == "drop" and rollout_ids:  # rollout 0 = samples 0 and 2, both on rank 0: both ranks refuse
            try:
                postprocess_rollout_data(args, 0, data)
                checks["dp2_drop_multi/refused"] = float("inf")
            except ValueError as e:
                checks["dp2_drop_multi/refused"] = 0.0 if "rollouts of several samples" in str(e) else float("inf")
            continue
        postprocess_rollout_data(args, 0, data)
        new, masks, _ = compute_tis_for_slime(
            args, pg_loss=mb.packed("pg_loss"), train_log_probs=mb.train, rollout_log_probs=mb.rollout,
            loss_masks=mb.masks, total_lengths=mb.total_lengths, response_lengths=mb.response_lengths)
        loss = slime_sum_of_sample_mean(new, mb, masks, 0, 1).detach().double()  # N_g of the whole rollout
        dist.all_reduce(loss, group=dp_group)
        ref = full_core(cfg, extra_finite=(b.packed("pg_loss"),))
        checks[f"dp2_{denominator}/loss"] = err(loss, rollout_mean(b.packed("pg_loss") * ref.weights, ref.keep_mask,
                                                                   b, denominator).double())
        COLLECTOR.flush()

    n_local_1 = len(owner_layout(b.total_lengths[1], b.response_lengths[1], cp)[1])
    result = {"checks": checks, "rank1_local_tokens_of_sample1": n_local_1}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    _worker(Path(parser.parse_args().out))
