"""MoE rollout routing replay through the megatron hook (``--tis-routing-replay``), in real torchrun processes
(tests/dist/routing_replay_worker.py: a megatron-core GPT whose first layer is dense and the other three
mixture-of-experts; the rollout engine is the same model with perturbed router weights).

One process: with replay the training forward uses exactly the engine's experts (``moe/routing_mismatch`` = 0)
while its own router disagrees on some decisions, without replay the mismatch is counted (and equals the
disagreement), and ``tis/k3_kl`` drops (to float32 noise where the engine differs only in its routers' choice);
gradients still reach the router; full activation recompute and the
rollout's pi_old pass give the same step; packed rows replay every decision (under CP they are refused); each bad
input is one line. Two processes: PP=2 (the dense layer alone
on stage 0, so the MoE index is global), PP=2 with 2 virtual stages (a chunk with only the dense layer), TP=2
(sequence parallel), EP=2, CP=2, DP=2, PP=2 with recompute, and PP=2 without replay each equal the one-process
step in loss, gradients and routing metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from _launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]
WORKER = HERE / "routing_replay_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("routing_replay")
    torchrun(WORKER, ["--out", str(out), "--plan", "single"], nproc=1, timeout=300, what="routing replay, 1 process")
    torchrun(WORKER, ["--out", str(out), "--plan", "layouts", "--ref", str(out / "ref.pt")], nproc=2, timeout=400,
             what="routing replay, layouts")
    single = json.loads((out / "single.json").read_text())
    layouts = [row for r in (0, 1) for row in json.loads((out / f"rank{r}.json").read_text())]
    return single, layouts


@pytest.mark.timeout(720)
def test_replay_uses_the_engines_experts_and_the_mismatch_is_counted_without(runs):
    single, _ = runs
    replay, plain = single["replay"], single["plain"]
    assert replay["moe/routing_decisions"] == plain["moe/routing_decisions"] > 200  # 8 rows x ~12 loss tokens x 3
    assert replay["moe/routing_mismatch"] == 0.0
    assert replay["moe/router_disagreement"] > 0.02  # the training router would have chosen otherwise
    assert plain["moe/routing_mismatch"] == plain["moe/router_disagreement"] == replay["moe/router_disagreement"]
    assert replay["tis/k3_kl"] < 0.2 * plain["tis/k3_kl"]  # measured 7.8e-7 vs 1.1e-5
    # an engine that differs from the trainer only in its routers' choice: with replay training computes its
    # network (k3 at float32 noise, as a dense model whose engine is the trainer: measured 3.6e-14), without
    # replay the routing alone gives k3 1.1e-5
    assert single["choice_replay"]["tis/k3_kl"] < 1e-10
    assert single["choice_plain"]["tis/k3_kl"] > 1e-6
    assert single["router_grad_norm"] > 0  # the weights of the replayed experts are the router's own scores
    assert single["grad_diff_replay_vs_plain"] > 1e-4  # replay changed the step
    # full recompute: the backward's recompute replays the same experts (megatron's REPLAY_BACKWARD queue)
    assert single["recompute_grad_err"] < 1e-6
    assert {k: single["recompute_metrics"][k] for k in replay if k.startswith("moe/")} == {
        k: v for k, v in replay.items() if k.startswith("moe/")}
    # sequence packing ([1, 4 x 16] rows; attention crosses the packed sequences on CPU, so only routing compares):
    # every decision replayed in the packed token order
    packed = single["packed"]
    assert packed["moe/routing_mismatch"] == 0.0 and packed["moe/routing_decisions"] == replay["moe/routing_decisions"]
    # the rollout's pi_old pass runs replayed too: the same step
    assert single["old_pass"]["moe/routing_mismatch"] == 0.0
    assert abs(single["old_pass"]["loss"] - replay["loss"]) < 1e-6


@pytest.mark.timeout(720)
def test_bad_routing_input_is_one_line(runs):
    errors = runs[0]["errors"]
    assert errors["no data"].startswith("ValueError: --tis-routing-replay / routing metrics: a micro-batch carries "
                                        "no routed experts")
    assert "moe_layers=2, topk=2], the model [B, S, moe_layers=3, topk=2]" in errors["layer count"]
    assert "moe_layers=3, topk=1], the model [B, S, moe_layers=3, topk=2]" in errors["k"]
    assert "routed experts give 56 tokens to MoE layer 0 on this rank, its router sees 64" in errors["shorter"]
    assert "needs the MoE routers built with moe_enable_routing_replay=True" in errors["not replay-enabled"]
    assert all("\n" not in e for e in errors.values())


@pytest.mark.timeout(720)
@pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2", "tp2", "ep2", "cp2", "dp2", "pp2_recompute", "pp2_no_replay"])
def test_layout_equals_one_process(runs, layout):
    single, rows = runs
    mine = [r for r in rows if r["layout"] == layout]
    assert len(mine) == 2 and not [r["error"] for r in mine if "error" in r], mine
    assert all(r["grad_err"] < 1e-5 for r in mine), [r["grad_err"] for r in mine]  # float32, reduction order
    ref = single["plain" if layout.endswith("no_replay") else "replay"]
    last = [r for r in mine if "metrics" in r]
    assert last
    for r in last:
        # routing counts are exact integers summed over ranks; the loss and k3 to float32 reduction order (TP)
        assert {k: v for k, v in r["metrics"].items() if k.startswith("moe/")} == {
            k: v for k, v in ref.items() if k.startswith("moe/")}
        assert abs(r["metrics"]["loss"] - ref["loss"]) < 1e-6
        assert abs(r["metrics"]["tis/k3_kl"] - ref["tis/k3_kl"]) < 1e-8
    if layout == "cp2":  # packed rows are split per sequence under CP, not in megatron's padded layout
        assert all(r["packed_cp"].startswith("ValueError: RoutingBatch(packed=True) with context parallelism is not "
                                             "supported") for r in mine)
