"""Agentic rollouts under slime's packing in 2 real processes (torchrun, gloo, megatron parallel_state).

The single-process harness of tests/test_slime_agentic.py (tests/_slime_sim.py: slime's ``build_dp_schedule``,
pi_old recompute, rollout-data hook, micro-batch losses, an optimizer step between
steps) runs on each rank with its share of the work, for three layouts of the two processes:

* DP = 2: each rank its partition of the rollout batch (multi-sample rollouts on both ranks with ``keep``), static
  ``--micro-batch-size 1`` and dynamic batching, with and without ``raw_reward``;
* CP = 2: every sample split in slime's zigzag chunks;
* TP = 2 (custom loss): vocabulary-parallel logits.

The step losses summed over the DP x CP ranks and the gradients summed over all ranks must equal the
oracle's (whole rollouts, one process, same parameters) at every step.

Run directly:
``python -m torch.distributed.run --nproc-per-node 2 tests/dist/test_slime_agentic_torchrun.py --out DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import torchrun

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]


@pytest.mark.dist
@pytest.mark.timeout(420)
def test_slime_agentic_dp_cp_tp(tmp_path):
    torchrun(HERE, ["--out", str(tmp_path)], timeout=400, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(res) >= 20, res
        bad = {k: v for k, v in res.items() if not v <= 2e-5}
        assert not bad, f"rank {rank}: errors above tolerance: {bad}"


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from _cpu import cpu_shim  # noqa: F401  (megatron on a CPU-only torch)
    from _slime_sim import (
        Layout,
        custom_loss_args,
        initial_weights,
        make_rollouts,
        oracle_step,
        schedule,
        slime_args,
        split_fraction,
        train_rollout,
    )
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = [1, 2, 3, 2, 4, 1, 2, 3]
    geo = dict(tis_mode="mask", tis_level="geometric", tis_upper_bound=1.05, tis_veto_threshold=1e-3)
    tok = dict(tis_mode="mask", tis_level="token", tis_upper_bound=1.3)
    seq = dict(tis_mode="truncate", tis_level="sequence", tis_upper_bound=1.5, tis_rs_level="sequence",
               tis_rs_upper_bound=3.0)
    cases = {  # name: (args, steps, one-sample rollouts); drop needs one-sample rollouts
        "a3_drop_geo_2steps": (custom_loss_args(tis_rejected_denominator="drop", **geo), 2, True),
        "a3_keep_seq_2steps": (custom_loss_args(**seq), 2, False),
        "a2_keep_geo_1step": (slime_args(use_tis=True, get_mismatch_metrics=True, **geo), 1, False),
        "a2_drop_tok_2steps": (slime_args(use_tis=True, tis_rejected_denominator="drop", **tok), 2, True),
        "a2_opsm_drop_1sample": (slime_args(use_tis=True, get_mismatch_metrics=True, use_opsm=True, opsm_delta=1e-3,
                                            tis_rejected_denominator="drop", **tok), 2, True),
    }
    layouts = {
        "dp2": dict(dp_rank=rank, dp_size=2),
        "cp2": dict(cp_rank=rank, cp_size=2),
        "tp2": dict(tp_rank=rank, tp_size=2),
    }
    checks: dict[str, float] = {}

    def total(x, group=None):
        x = x.detach().clone().double()
        dist.all_reduce(x, group=group)
        return x

    for lname, lkw in layouts.items():
        kw = {"dp2": {}, "cp2": dict(context_parallel_size=2), "tp2": dict(tensor_model_parallel_size=2)}[lname]
        ps.initialize_model_parallel(**kw)
        lay = Layout(**lkw)
        loss_group = ps.get_data_parallel_group(with_context_parallel=True)
        for cname, (args, steps, single) in cases.items():
            if lname == "tp2" and args.loss_type != "custom_loss":
                continue  # the TIS-hook harness computes log-probs on the full vocabulary
            dynamic = dict(max_tokens=30 // lay.cp_size)  # tokens per GPU: bins of 30 tokens over the CP group
            packings = [dict(micro_batch_size=1), dynamic] if lname == "dp2" else [dynamic]
            for p, packing in enumerate(packings):
                w0 = initial_weights(1)
                multi = sizes if p else [2, 2, 4, 2, 2, 4, 2, 2]  # static packing: an even count per step for DP
                ro = make_rollouts(3 + p, [1] * 8 if single else multi, w0, spread=0.6 if single else 0.35)
                sched = schedule(ro, steps=steps, dp_size=lay.dp_size, cp_size=lay.cp_size, **packing)
                data_kw = dict(raw_reward=p == 0)  # the dynamic packing runs without raw_reward
                res = train_rollout(args, ro, w0, sched, lay, lr=1.0, all_reduce=lambda g: total(g).float(),
                                    data_kw=data_kw)
                for s, r in enumerate(res):
                    positions = [None] * dist.get_world_size()
                    dist.all_gather_object(positions, r.positions)
                    step_positions = sorted({j for ps_ in positions for j in ps_}) if lay.dp_size > 1 else r.positions
                    w = r.w.clone().requires_grad_(True)
                    want = oracle_step(args, ro, w, step_positions, sched[3][s], w0)
                    (grad,) = torch.autograd.grad(want, w)
                    got = total(r.loss, loss_group)
                    key = f"{lname}/{cname}/pack{p}/step{s}"
                    checks[f"{key}/loss"] = float((got - want.double()).abs() / want.double().abs().clamp(min=1e-3))
                    g = total(r.grad)
                    checks[f"{key}/grad"] = float((g - grad.double()).abs().max() / grad.abs().max().clamp(min=1e-3))
                if not single:
                    checks[f"{lname}/{cname}/pack{p}/split"] = 0.0 if split_fraction(ro, sched) >= 0.5 else 1.0
        ps.destroy_model_parallel()
    (out / f"rank{rank}.json").write_text(json.dumps(checks, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    _worker(Path(parser.parse_args().out))
