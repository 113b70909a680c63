"""What the torchrun checks run: parallel layouts, correction cases, and the check lists (no heavy imports).

Shared by ``megatron_worker.py`` (inside torchrun) and ``test_megatron_dist.py`` (pytest collection), so
the pytest process never imports megatron or the CPU shim.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    per_token: bool = False  # config.calculate_per_token_loss (3-tuple loss form)
    vpp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B schedule)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world: int) -> int:
        return world // self.model_parallel


LAYOUTS = {
    "pp2": Layout(pp=2), "tp2": Layout(tp=2), "cp2": Layout(cp=2), "dp2": Layout(),
    "dp2_pt": Layout(per_token=True), "cp2_pt": Layout(cp=2, per_token=True),
    "pp2vpp2": Layout(pp=2, vpp=2), "tp2pp2": Layout(tp=2, pp=2), "dp2cp2": Layout(cp=2),
    "single": Layout(),
}

#: TISConfig fields of each correction case (algorithms 0-3; token truncate, sequence mask, geometric
#: mask with veto, clip, rejection sampling, batch normalisation, both denominators, all aggregations).
CASES: dict[str, dict] = {
    "a0": dict(),
    "a1_geo_mask_veto": dict(use_rollout_log_probs=True, mode="mask", level="geometric", upper=1.3,
                             veto_threshold=0.05),
    "a2_tok_trunc": dict(use_tis=True, mode="truncate", level="token", upper=1.5),
    "a2_seq_mask_bn": dict(use_tis=True, mode="mask", level="sequence", upper=3.0, batch_normalize=True,
                           loss_agg="seq-mean-token-mean"),
    "a2_geo_clip_drop_rs": dict(use_tis=True, mode="clip", level="geometric", upper=1.2, rs_level="sequence",
                                rs_upper=4.0, rejected_denominator="drop", loss_agg="seq-mean-token-sum"),
    "a3_geo_mask_veto_drop": dict(use_rollout_log_probs=True, use_tis=True, mode="mask", level="geometric",
                                  upper=1.3, veto_threshold=0.05, rs_level="token", rs_upper=5.0,
                                  rejected_denominator="drop"),
    "a3_tok_trunc_bn": dict(use_rollout_log_probs=True, use_tis=True, mode="truncate", level="token",
                            upper=1.5, batch_normalize=True),
}

#: The correction cases above, each under every layout of the main plans.
CORRECTION_CASES = tuple(CASES)

#: The policy-loss registry composed with the correction (surrogates, aggregations, reference-KL and entropy
#: terms): plan "registry", each under DP=2, CP=2 and PP=2.
REGISTRY_CASES: dict[str, dict] = {
    # anchor pi_rollout: the ratio is not 1 (pi_old is the step's own sg(pi_theta) here, where anchors at pi_old
    # give ratio 1), so the sequence mean needs the CP reduction
    "a1_gspo_geo_rs": dict(use_rollout_log_probs=True, loss_mode="gspo", rs_level="geometric", rs_upper=1.5,
                           loss_agg="seq-mean-token-mean"),
    "a2_gspo_seq_is": dict(use_tis=True, level="sequence", upper=3.0, loss_mode="gspo", eps_clip=0.05,
                           loss_agg="seq-mean-token-mean"),
    "a1_cispo_mask_token_sum": dict(use_rollout_log_probs=True, loss_mode="cispo", mode="mask", upper=1.5,
                                    loss_agg="token-sum"),
    "a2_cispo_geo_mask_drop": dict(use_tis=True, loss_mode="cispo", mode="mask", level="geometric", upper=1.3,
                                   rejected_denominator="drop", loss_agg="seq-mean-token-sum"),
    "a3_on_policy_terms_drop": dict(use_rollout_log_probs=True, use_tis=True, loss_mode="on_policy", kl_coef=0.2,
                                    kl_importance_weighted=True, entropy_coef=0.01, veto_threshold=0.05,
                                    rs_level="token", rs_upper=5.0, rejected_denominator="drop"),
    "a0_kl_k2_entropy_seq": dict(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.02, loss_agg="seq-mean-token-sum"),
}
CASES.update(REGISTRY_CASES)

NPROC = {"main2": 2, "registry": 2, "main4": 4, "smoke": 2, "one": 1, "train_step1": 1, "train_step2": 2}

#: checks with ``kind`` "rollout" (2 optimizer steps on one rollout, pi_old computed once) or "supplied"
#: (caller-supplied pi_old used as given) compare with a hand computation of the clipped PPO loss
ROLLOUT_CASES = ("a0", "a2_tok_trunc")


def plan_checks(plan: str) -> list[dict]:
    """The checks of a plan, each ``dict(layout, case, M[, tag, reducer, masked, patch, tp0_data, avg_coll,
    opaque, kind])``."""
    checks: list[dict] = []
    if plan == "main2":
        for layout in ("pp2", "tp2", "cp2", "dp2"):
            for case in CORRECTION_CASES:
                for m in (1, 4):
                    checks.append(dict(layout=layout, case=case, M=m))
        for case in CORRECTION_CASES:  # interleaved schedule: a list of data iterators and model chunks
            checks.append(dict(layout="pp2vpp2", case=case, M=4))
        for layout in ("dp2_pt", "cp2_pt"):
            for case in ("a0", "a2_seq_mask_bn", "a3_geo_mask_veto_drop"):
                checks.append(dict(layout=layout, case=case, M=2))
        # controls: the same checks with a deliberately broken reducer must FAIL
        checks.append(dict(layout="cp2", case="a2_seq_mask_bn", M=2, tag="no_cp_reduce", reducer="nocp"))
        checks.append(dict(layout="cp2", case="a3_geo_mask_veto_drop", M=2, tag="no_cp_reduce",
                           reducer="nocp"))
        checks.append(dict(layout="dp2", case="a2_tok_trunc", M=2, tag="mean_of_minima", reducer="meanmin"))
        # all-masked data: rank 1's first micro-batch (rows 2, 3 with dp=2, M=2); all of rank 1's rows;
        # under CP=2 a whole global micro-batch
        checks.append(dict(layout="dp2", case="a3_tok_trunc_bn", M=2, tag="masked_mb", masked=(2, 3)))
        checks.append(dict(layout="dp2", case="a2_seq_mask_bn", M=2, tag="masked_rank", masked=(2, 3, 6, 7)))
        checks.append(dict(layout="cp2", case="a1_geo_mask_veto", M=2, tag="masked_mb", masked=(0, 1, 2, 3)))
        # the user-facing patch (tis_patch, slime_tis/megatron/hook.py) under PP=2
        checks.append(dict(layout="pp2", case="a2_tok_trunc", M=2, tag="patch", patch=True))
        # Megatron-LM's data layout: only TP rank 0 has a data iterator (the hook broadcasts the TISBatch items)
        checks.append(dict(layout="tp2", case="a2_seq_mask_bn", M=2, tag="tp0_data", tp0_data=True))
        # gradient averaging read from megatron DDP with average_in_collective; an opaque wrapper must raise
        checks.append(dict(layout="dp2", case="a2_tok_trunc", M=2, tag="avg_in_collective", avg_coll=True))
        checks.append(dict(layout="dp2", case="a0", M=2, tag="opaque_wrapper", opaque=True))
        # algorithm 0 with rollout log-probs on DP rank 0 only: no hang (a clear error or the right step)
        checks.append(dict(layout="dp2", case="a0", M=2, tag="no_rollout_rank1", no_rollout_dp_rank=1))
        # several optimizer steps per rollout: pi_old once per rollout, clip active in step 2
        for layout in ("pp2", "dp2"):
            for case in ROLLOUT_CASES:
                checks.append(dict(layout=layout, case=case, M=2, tag="rollout", kind="rollout"))
        checks.append(dict(layout="pp2", case="a0", M=2, tag="supplied", kind="supplied"))
    elif plan == "main4":
        for layout in ("tp2pp2", "dp2cp2"):
            for case in CORRECTION_CASES:
                checks.append(dict(layout=layout, case=case, M=4 if layout == "tp2pp2" else 2))
    elif plan == "one":
        for case in ROLLOUT_CASES:
            checks.append(dict(layout="single", case=case, M=2, tag="rollout", kind="rollout"))
            checks.append(dict(layout="single", case=case, M=2, tag="supplied", kind="supplied"))
        # control: the old per-step recompute on the same two steps (rho = 1 in step 2): must disagree
        checks.append(dict(layout="single", case="a0", M=2, tag="per_step_control", kind="per_step_control"))
        # a schedule that passes return_schedule_plan= to forward_step (recompute pass and training)
        checks.append(dict(layout="single", case="a2_seq_mask_bn", M=2, tag="keyword", keyword=True))
    elif plan == "train_step1":  # Megatron-LM's real train_step (megatron-core >= 0.17)
        for case in ("a0", "a2_seq_mask_bn", "a3_geo_mask_veto_drop"):
            checks.append(dict(layout="single", case=case, M=2, tag="train_step", train_step=True))
    elif plan == "train_step2":
        for layout in ("dp2", "pp2", "tp2"):
            for case in ("a2_seq_mask_bn", "a3_geo_mask_veto_drop"):
                checks.append(dict(layout=layout, case=case, M=2, tag="train_step", train_step=True))
    elif plan == "registry":
        for layout in ("dp2", "cp2", "pp2"):
            for case in REGISTRY_CASES:
                checks.append(dict(layout=layout, case=case, M=2))
    elif plan == "smoke":
        checks.append(dict(layout="dp2", case="a2_tok_trunc", M=2))
    else:
        raise ValueError(f"unknown plan {plan!r}")
    return checks


def check_id(check: dict) -> str:
    tag = f"-{check['tag']}" if check.get("tag") else ""
    return f"{check['layout']}-{check['case']}-M{check['M']}{tag}"
