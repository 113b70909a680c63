"""The example's mixture-of-experts option: the engine's MoE routing (same rule as megatron-core's TopKRouter,
in the decode dtype), SGLang's ``routed_experts`` wire format (parsed by ``slime_tis.sglang.parse_routed_experts``)
and its layout in the batch, the megatron MoE export, and rollout routing replay (the plugin's
``--tis-routing-replay`` feature, ``slime_tis.megatron.routing_replay``) in real training runs (the routing
mismatch is 0 and ``tis/k3_kl`` drops with replay)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.rl.batch import routed_experts_rows  # noqa: E402
from examples.rl.model import GELU_TANH, KVCacheGPT, ModelConfig, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from examples.rl.rollout import RolloutSettings, collect_rollout  # noqa: E402
from examples.rl.rollout_engine import EmbeddedEngine, encode_routed_experts  # noqa: E402
from examples.rl.task import DigitTask  # noqa: E402
from slime_tis.sglang import parse_routed_experts  # noqa: E402

CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, max_seq_len=16, moe_experts=4, moe_topk=2)


def moe_weights(cfg: ModelConfig = CFG, seed: int = 0, gate_scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Random GPT-2-layout MoE weights. A small ``gate_scale`` puts the router logits close together (as at
    initialisation), where rounding them to bf16 reorders some of them."""
    g = torch.Generator().manual_seed(seed)
    h, v, e = cfg.hidden_size, cfg.vocab_size, cfg.moe_experts
    w = {
        "transformer.wte.weight": torch.randn(v, h, generator=g) * 0.3,
        "transformer.wpe.weight": torch.randn(cfg.max_seq_len, h, generator=g) * 0.3,
        "transformer.ln_f.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "transformer.ln_f.bias": torch.zeros(h),
    }
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            w[p + ln + ".weight"] = 1 + 0.1 * torch.randn(h, generator=g)
            w[p + ln + ".bias"] = 0.1 * torch.randn(h, generator=g)
        w[p + "attn.c_attn.weight"] = torch.randn(h, 3 * h, generator=g) / math.sqrt(h)
        w[p + "attn.c_attn.bias"] = 0.1 * torch.randn(3 * h, generator=g)
        w[p + "attn.c_proj.weight"] = torch.randn(h, h, generator=g) / math.sqrt(h)
        w[p + "attn.c_proj.bias"] = 0.1 * torch.randn(h, generator=g)
        w[p + "mlp.gate.weight"] = torch.randn(e, h, generator=g) * gate_scale
        for x in range(e):
            w[p + f"mlp.experts.{x}.c_fc.weight"] = torch.randn(h, 4 * h, generator=g) / math.sqrt(h)
            w[p + f"mlp.experts.{x}.c_proj.weight"] = torch.randn(4 * h, h, generator=g) / math.sqrt(4 * h)
    return w


def test_moe_config_validation_and_hf_config():
    with pytest.raises(ValueError, match="moe_topk must be in \\[1, moe_experts=4\\], got 5"):
        ModelConfig(moe_experts=4, moe_topk=5)
    with pytest.raises(ValueError, match="moe_experts must be >= 0"):
        ModelConfig(moe_experts=-1)
    hf = CFG.to_hf_config(11)
    assert hf["num_local_experts"] == 4 and hf["num_experts_per_tok"] == 2
    assert "num_local_experts" not in ModelConfig().to_hf_config(11)  # the dense config is unchanged


def test_engine_moe_block_is_topk_softmax_over_chosen_logits():
    """fp32 engine MoE block == the rule written out: top-2 experts by gate logit, weights softmax over those two
    logits, output the weighted sum of the two experts' MLPs (no biases)."""
    w = moe_weights()
    dec = KVCacheGPT(CFG, w, dtype=torch.float32)
    m = torch.randn(3, 5, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    routes: list[torch.Tensor] = []
    out = dec._moe(m, "transformer.h.0.", routes)
    logits = m @ w["transformer.h.0.mlp.gate.weight"].t()
    ref = torch.zeros_like(m)
    for b in range(3):
        for t in range(5):
            order = sorted(range(4), key=lambda e: -float(logits[b, t, e]))[:2]
            z = torch.stack([logits[b, t, e] for e in order])
            wts = torch.softmax(z, 0)
            for wt, e in zip(wts, order):
                p = f"transformer.h.0.mlp.experts.{e}."
                ref[b, t] += wt * (GELU_TANH(m[b, t] @ w[p + "c_fc.weight"]) @ w[p + "c_proj.weight"])
            assert set(routes[0][b, t].tolist()) == set(order)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # fp32, the same ops in another order


def test_bf16_engine_routes_some_tokens_to_other_experts_than_fp32():
    w = moe_weights()
    tok = torch.randint(0, 16, (16, 12), generator=torch.Generator().manual_seed(2))
    r32: list[torch.Tensor] = []
    r16: list[torch.Tensor] = []
    KVCacheGPT(CFG, w, dtype=torch.float32).forward(tok, 0, None, r32)
    KVCacheGPT(CFG, w, dtype=torch.bfloat16).forward(tok, 0, None, r16)
    a = torch.stack(r32).sort(-1).values
    b = torch.stack(r16).sort(-1).values
    differ = (a != b).any(-1).float().mean().item()
    assert 0.005 < differ < 0.5, differ  # some decisions flip, most do not


def test_engine_returns_routed_experts_for_every_token_it_ran():
    engine = EmbeddedEngine(CFG)
    engine.load_weights(moe_weights())
    prompts = [[1, 2, 3, 10], [4, 5, 6, 10]]
    req = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 6, "stop_token_ids": [11], "sampling_seed": 3},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    out = engine.generate(req)
    for prompt, r in zip(prompts, out):
        meta = r["meta_info"]
        n = len(prompt) + meta["completion_tokens"] - 1
        experts = parse_routed_experts(meta["routed_experts"], num_tokens=n, moe_layers=2, topk=2, num_experts=4)
        assert experts.shape == (n, CFG.num_layers, CFG.moe_topk)
        # the experts of the tokens the engine ran equal a full bf16 forward over those tokens
        routes: list[torch.Tensor] = []
        seq = torch.tensor([prompt + r["output_ids"][:-1]])
        KVCacheGPT(CFG, moe_weights(), dtype=torch.bfloat16).forward(seq, 0, None, routes)
        full = torch.stack(routes, dim=2)[0]  # [n, layers, k]
        agree = (full.sort(-1).values == experts.sort(-1).values).all(-1).float().mean().item()
        assert agree > 0.95  # incremental decoding vs one full pass: bf16 summation order may flip a near-tie
    plain = engine.generate({**req, "return_routed_experts": False})
    assert "routed_experts" not in plain[0]["meta_info"]
    dense_cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, max_seq_len=16)
    dense_w = {k: v for k, v in moe_weights().items() if ".mlp." not in k}
    for i in range(2):
        p = f"transformer.h.{i}.mlp."
        dense_w |= {p + "c_fc.weight": torch.zeros(32, 128), p + "c_fc.bias": torch.zeros(128)}
        dense_w |= {p + "c_proj.weight": torch.zeros(128, 32), p + "c_proj.bias": torch.zeros(32)}
    dense = EmbeddedEngine(dense_cfg)
    dense.load_weights(dense_w)
    with pytest.raises(ValueError, match="return_routed_experts=true needs a mixture-of-experts model"):
        dense.generate(req)
    with pytest.raises(ValueError, match="return_routed_experts must be true or false, got 'yes'"):
        engine.generate({**req, "return_routed_experts": "yes"})


def test_routed_experts_wire_format_and_batch_layout():
    x = torch.tensor([[[0, 3], [1, 2]], [[2, 1], [3, 0]], [[1, 0], [0, 1]]])  # [3 positions, 2 layers, k=2]
    wire = encode_routed_experts(x)
    assert torch.equal(parse_routed_experts(wire, num_tokens=3, moe_layers=2, topk=2, num_experts=4).long(), x)
    with pytest.raises(ValueError, match="not a multiple of 4 x moe_layers \\(2\\) x topk \\(5\\)"):
        parse_routed_experts(wire, num_tokens=3, moe_layers=2, topk=5, num_experts=8)
    resp = {"meta_info": {"prompt_tokens": 2, "completion_tokens": 2, "routed_experts": wire}}
    rows = routed_experts_rows([resp], seq_len=6, num_layers=2, topk=2, num_experts=4)
    assert rows.shape == (1, 6, 2, 2)
    assert torch.equal(rows[0, :3].long(), x) and (rows[0, 3:] == -1).all()
    bad = {"meta_info": {**resp["meta_info"], "completion_tokens": 3}}
    with pytest.raises(ValueError, match="response 0: routed_experts covers 3 positions .* fewer than the 4"):
        routed_experts_rows([bad], seq_len=6, num_layers=2, topk=2, num_experts=4)
    with pytest.raises(ValueError, match="response 0: routed_experts has expert id 3 outside \\[0, num_experts=3\\)"):
        routed_experts_rows([resp], seq_len=6, num_layers=2, topk=2, num_experts=3)
    with pytest.raises(ValueError, match="response 0 has no meta_info.routed_experts"):
        routed_experts_rows([{"meta_info": {}}], seq_len=6, num_layers=2, topk=2, num_experts=4)


def test_collect_rollout_carries_routed_experts_aligned_with_tokens():
    """In the batch, routed_experts[i, s] belongs to input token s: rows are -1 exactly from the last response
    token on (the engine never ran it)."""
    task = DigitTask(num_digits=3)
    cfg = ModelConfig(hidden_size=32, num_heads=4, max_seq_len=16, moe_experts=4, moe_topk=2)
    engine = EmbeddedEngine(cfg)
    engine.load_weights(moe_weights(cfg))
    batch = collect_rollout(engine, task, RolloutSettings(4, 2, routed_experts_shape=(2, 2, 4)), step=0)
    ran = (batch.routed_experts >= 0).all(-1).all(-1)  # [N, S]
    plen = batch.prompts.shape[1]
    for i in range(batch.num_sequences):
        n = plen + int(batch.response_lengths[i]) - 1
        assert ran[i, :n].all() and not ran[i, n:].any()
        assert batch.loss_mask[i].nonzero().max() == n - 1  # every loss position has the engine's experts
    assert batch.rows(0, 2).routed_experts.shape[0] == 2


def test_hf_checkpoint_round_trip_keeps_experts(tmp_path):
    w = moe_weights()
    save_hf_checkpoint(str(tmp_path), w, CFG, 11)
    cfg, loaded = load_hf_checkpoint(str(tmp_path))
    assert cfg == CFG and loaded.keys() == w.keys()
    assert all(torch.equal(loaded[k], w[k]) for k in w)
    engine = EmbeddedEngine(CFG)
    assert engine.update_weights_from_disk(str(tmp_path))["success"]


def test_megatron_moe_export_matches_kv_cache_decoder():
    """megatron-core MoE GPT (fp32) and the engine reading its export (fp32, KV cache): same logits and the same
    experts per token; replaying given experts through megatron's router gives the decoder's logits when the
    decoder is forced to the same experts (here: the experts it chose itself in bf16)."""
    code = textwrap.dedent("""
        import torch, warnings; warnings.filterwarnings("ignore")
        from examples.rl.dist import init_distributed, shutdown
        from examples.rl.model import ModelConfig, build_megatron_gpt, gather_gpt2_weights, KVCacheGPT
        from slime_tis.megatron import RoutingBatch
        from slime_tis.megatron.routing_replay import RoutingReplay
        init_distributed(seed=3)
        cfg = ModelConfig(hidden_size=32, moe_experts=4, moe_topk=2)
        m = build_megatron_gpt(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * torch.randn_like(p))
        tok = torch.randint(0, 16, (3, 10))
        mask = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1).view(1, 1, 10, 10)
        pos = torch.arange(10).expand(3, 10)
        routes = []
        cap = []
        for layer in m.decoder.layers:
            layer.mlp.router.register_forward_hook(lambda mod, i, o: cap.append(o[1]))
        ref = m(tok, pos, mask)
        w = gather_gpt2_weights(m, cfg)
        dec = KVCacheGPT(cfg, w, dtype=torch.float32)
        logits, cache = dec.forward(tok[:, :6], 0, None, routes)
        outs = [logits]
        for t in range(6, 10):
            logits, cache = dec.forward(tok[:, t:t + 1], t, cache, routes)
            outs.append(logits)
        err = (torch.cat(outs, 1) - ref).abs().max().item()
        per_layer = [torch.cat(routes[l::2], dim=1) for l in range(2)]  # [B, S, k] per layer
        dec_map = [torch.nn.functional.one_hot(r.transpose(0, 1).reshape(-1, 2), 4).sum(-2) > 0 for r in per_layer]
        route_eq = all(torch.equal(dec_map[l], cap[l]) for l in range(2))
        # replay: the bf16 engine's experts, forced on megatron
        r16 = []
        KVCacheGPT(cfg, w, dtype=torch.bfloat16).forward(tok, 0, None, r16)
        eng = torch.stack(r16, dim=2)  # [B, S, layers, k]
        item = {"routing": RoutingBatch(eng, torch.ones(3, 10, dtype=torch.bool))}
        cap.clear()
        with RoutingReplay(replay=True, count=False).active(lambda it, mod: mod(tok, pos, mask) if next(it) else None,
                                                            training=False) as step:
            replayed = step(iter([item]), m)
        forced = [torch.nn.functional.one_hot(eng[:, :, l].transpose(0, 1).reshape(-1, 2), 4).sum(-2) > 0
                  for l in range(2)]
        replay_eq = all(torch.equal(forced[l], cap[l]) for l in range(2))
        changed = sum(int((forced[l] != dec_map[l]).any(-1).sum()) for l in range(2))
        print("RES", err, int(route_eq), int(replay_eq), changed, (replayed - ref).abs().max().item())
        shutdown()
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    err, route_eq, replay_eq, changed, replay_delta = out.stdout.split("RES")[1].split()
    assert float(err) < 1e-5  # fp32 both sides, different summation order
    assert route_eq == "1"  # the decoder's experts are megatron's router's
    assert replay_eq == "1"  # with replay, megatron's router used exactly the given experts
    assert (int(changed) > 0) == (float(replay_delta) > 1e-6)  # logits move iff some expert choice was changed


def _train(run_dir, *extra: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "examples.rl.train", "--run-dir", str(run_dir), "--no-progress", "--steps", "4",
        "--prompts-per-step", "16", "--group-size", "4", "--dump-interval", "0", "--lr", "1e-2",
        "--moe-experts", "4", "--moe-topk", "2", "--use-tis", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_routing_replay_removes_the_routing_mismatch_and_lowers_k3(tmp_path):
    """Same seed, same initial weights and prompts: without replay training routes some loss tokens to other
    experts than the bf16 engine did; with replay it uses the engine's experts (mismatch exactly 0 at every
    step, though its own router still disagrees), and the training/rollout k3 KL over the steps after the first
    update is less than half (measured: 9.4e-5 vs 6.1e-6)."""
    plain = _train(tmp_path / "plain")
    replay = _train(tmp_path / "replay", "--routing-replay")
    assert all(r["moe/routing_decisions"] > 400 for r in plain + replay)  # 64 sequences x >= 3 tokens x 2 layers
    assert sum(r["moe/routing_mismatch"] for r in plain) > 0.005
    assert all(r["moe/routing_mismatch"] == r["moe/router_disagreement"] for r in plain)
    assert all(r["moe/routing_mismatch"] == 0.0 for r in replay)
    assert sum(r["moe/router_disagreement"] for r in replay) > 0.005  # replay overrode real disagreements
    k3_plain = sum(r["tis/k3_kl"] for r in plain[1:])
    k3_replay = sum(r["tis/k3_kl"] for r in replay[1:])
    assert k3_replay < 0.5 * k3_plain, (k3_replay, k3_plain)


def test_launcher_validates_moe_arguments():
    from examples.rl.train import build_parser, validate

    with pytest.raises(ValueError, match="--routing-replay .* needs --moe-experts > 0"):
        validate(build_parser().parse_args(["--routing-replay"]), world_size=1)
    with pytest.raises(ValueError, match="--moe-topk must be in \\[1, --moe-experts=4\\], got 5"):
        validate(build_parser().parse_args(["--moe-experts", "4", "--moe-topk", "5"]), world_size=1)
    with pytest.raises(ValueError, match="--moe-experts must be >= 0, got -2"):
        validate(build_parser().parse_args(["--moe-experts", "-2"]), world_size=1)


def _write_moe_run(d, k3: float, mismatch: float | None, n: int = 12) -> None:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for s in range(n):
            r = {
                "step": s,
                "reward": 0.1 + 0.01 * s,
                "grad_norm": 1.0,
                "tis/k3_kl": k3,
                "tis/rejected_token_fraction": 0,
            }
            if mismatch is not None:
                r.update({"moe/routing_mismatch": mismatch, "moe/router_disagreement": 0.05})
            f.write(json.dumps(r) + "\n")


def test_compare_table_and_headline_for_moe_settings(tmp_path):
    from examples.compare import headline, table

    for seed in range(3):
        _write_moe_run(tmp_path / f"moe-alg2-s{seed}", 1e-4 * (seed + 1), 0.05)
        _write_moe_run(tmp_path / f"moe-replay-alg2-s{seed}", 2e-6, 0.0)
        _write_moe_run(tmp_path / f"bf16-alg2-s{seed}", 1e-5, None)
    lines = table(str(tmp_path), ["bf16", "moe", "moe-replay"], ["2"], [0, 1, 2]).splitlines()
    assert lines[0].endswith("| routing mismatch (used vs engine) | router disagreement |")
    assert lines[2].endswith("| n/a | n/a |")  # dense: no routing
    assert lines[3].endswith("| 0.0500 ± 0.0000 | 0.0500 ± 0.0000 |")
    assert lines[4].endswith("| 0.0000 ± 0.0000 | 0.0500 ± 0.0000 |")
    assert "routing mismatch" not in table(str(tmp_path), ["bf16"], ["2"], [0, 1, 2]).splitlines()[0]
    text = headline(str(tmp_path), ["moe", "moe-replay"], ["2"], [0, 1, 2]).splitlines()
    assert text[0] == (
        "alg 2 seed 0: moe: k3_kl 1.00e-04, routing mismatch 0.0500 | "
        "moe-replay: k3_kl 2.00e-06, routing mismatch 0.0000 (ratio 50.0x; lower on 12 of 12 steps)"
    )
    # ratios 50, 100, 150: geometric mean 90.9; log ratios 3.91, 4.61, 5.01, s = 0.556, half = 4.303 s / sqrt(3)
    assert text[3:] == [
        "alg 2, moe-replay vs moe: mean tis/k3_kl lower under moe-replay on 3 of 3 seeds "
        "(ratio per seed 50.0x, 100x, 150x; sign test p = 0.25)",
        "  geometric-mean ratio 90.9x, 95 % paired interval over seeds [22.9x, 361x]",
        "  per step: lower on 36 of 36 (seed, step) pairs; ratio of per-step medians 50.0x-150x over seeds",
        "  verdict: lower on every seed, and the paired interval excludes 1x: moe-replay lowers the mismatch in "
        "these runs",
    ]
    # one seed the other way, and no canned claim: the verdict says what these runs show
    _write_moe_run(tmp_path / "moe-replay-alg2-s1", 4e-4, 0.0)
    text = headline(str(tmp_path), ["moe", "moe-replay"], ["2"], [0, 1, 2]).splitlines()
    assert "(ratio 0.5x; lower on 0 of 12 steps)" in text[1]
    assert text[-1] == "  verdict: lower on 2 of 3 seeds only: no consistent direction in these runs"
    # all seeds one way but a wide interval: the direction, not a statistical claim
    _write_moe_run(tmp_path / "moe-replay-alg2-s1", 1.9e-4, 0.0)
    assert headline(str(tmp_path), ["moe", "moe-replay"], ["2"], [0, 1, 2]).splitlines()[-1] == (
        "  verdict: lower on every seed, but 3 seeds do not rule out chance (the paired interval includes 1x; "
        "sign test p = 0.25): more seeds (SEEDS=...) make it a statistical claim"
    )


def test_results_table_moe_preset(tmp_path):
    rec, fake = tmp_path / "argv.txt", tmp_path / "fake_python.sh"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {rec}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "GRID": "moe"}
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", "results_table.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    argv = rec.read_text().splitlines()
    assert argv[argv.index("--algs") + 1 : argv.index("--mismatch")] == ["0", "2", "2-geo-mis", "3-seq"]
    assert argv[argv.index("--mismatch") + 1 : argv.index("--mismatch") + 4] == ["bf16", "moe", "moe-replay"]
    assert "--train-args=--steps-per-rollout 2 --ppo-epochs 2" in argv
    assert argv[argv.index("--seeds") + 1 : argv.index("--seeds") + 6] == ["0", "1", "2", "3", "4"]
    assert argv[argv.index("--steps") + 1] == "50" and argv[argv.index("--out-dir") + 1] == "runs/results_moe"
    from examples.compare import ALG_FLAGS, MISMATCH

    assert ALG_FLAGS["3-seq"] == ["--use-rollout-log-probs", "--use-tis", "--tis-level", "sequence"]
    assert MISMATCH["moe-replay"] == [*MISMATCH["moe"], "--routing-replay"]


def test_http_path_carries_routed_experts_and_moe_weights(tmp_path):
    """Over HTTP (the --sglang-url path): the MoE checkpoint is pushed with /update_weights_from_disk and the
    routed experts come back in meta_info exactly as from the in-process engine."""
    from examples.rl.http_client import SGLangClient
    from examples.rl.http_server import serve
    from examples.rl.weight_sync import DiskWeightSync

    engine = EmbeddedEngine(CFG)
    server, url = serve(engine, weights_root=str(tmp_path))
    try:
        client = SGLangClient(url)
        client.wait_healthy(timeout=10)
        DiskWeightSync(client, str(tmp_path / "w"), CFG, 11).push(moe_weights(), 0)
        req = {
            "input_ids": [[1, 2, 3, 10]] * 2,
            "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [11], "sampling_seed": 5},
            "return_logprob": True,
            "return_routed_experts": True,
        }
        over_http = client.generate(req)
        local = EmbeddedEngine(CFG)
        local.load_weights(moe_weights())
        direct = local.generate(req)
        assert [r["meta_info"]["routed_experts"] for r in over_http] == [
            r["meta_info"]["routed_experts"] for r in direct
        ]
        assert [r["output_ids"] for r in over_http] == [r["output_ids"] for r in direct]
    finally:
        server.shutdown()
        server.server_close()
