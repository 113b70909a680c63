"""Unit tests of the example job's parts that need no process group: task reward, GRPO advantages,
the bf16 KV-cache engine and its SGLang response shape, the HTTP server/client, weight sync with lag,
and the batch layout built through the plugin's SGLang parser."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from examples.rl.batch import build_batch, grpo_advantages, parse_responses  # noqa: E402
from examples.rl.http_client import SGLangClient, SGLangHTTPError  # noqa: E402
from examples.rl.http_server import serve  # noqa: E402
from examples.rl.model import KVCacheGPT, ModelConfig, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from examples.rl.rollout import RolloutSettings, collect_rollout, make_request  # noqa: E402
from examples.rl.rollout_engine import EmbeddedEngine, EngineNotReadyError  # noqa: E402
from examples.rl.task import EOS, SEP, DigitTask  # noqa: E402
from examples.rl.weight_sync import DiskWeightSync, InProcessWeightSync, LaggedWeightSync  # noqa: E402

CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, max_seq_len=16)


def random_weights(cfg: ModelConfig = CFG, seed: int = 0, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """Random GPT-2-layout weights (large enough that bf16 rounding visibly moves the log-probs)."""
    g = torch.Generator().manual_seed(seed)
    h, v = cfg.hidden_size, cfg.vocab_size
    w = {
        "transformer.wte.weight": torch.randn(v, h, generator=g) * scale,
        "transformer.wpe.weight": torch.randn(cfg.max_seq_len, h, generator=g) * scale,
        "transformer.ln_f.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "transformer.ln_f.bias": torch.zeros(h),
    }
    shapes = {"attn.c_attn": (h, 3 * h), "attn.c_proj": (h, h), "mlp.c_fc": (h, 4 * h), "mlp.c_proj": (4 * h, h)}
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            w[p + ln + ".weight"] = 1 + 0.1 * torch.randn(h, generator=g)
            w[p + ln + ".bias"] = 0.1 * torch.randn(h, generator=g)
        for name, shape in shapes.items():
            w[p + name + ".weight"] = torch.randn(*shape, generator=g) * scale / math.sqrt(shape[0]) * 4
            w[p + name + ".bias"] = 0.1 * torch.randn(shape[1], generator=g)
    return w


# ----------------------------------------------------------------------------------------------- task
def test_reward_is_exact_fraction_of_correct_digits():
    task = DigitTask(num_digits=3, transform="reverse")
    prompts = torch.tensor([[1, 2, 3, SEP]] * 5)
    responses = [[3, 2, 1, EOS], [3, 2, 9, EOS], [3, EOS, 1], [], [3, 2, 1, 1]]
    assert task.rewards(prompts, responses).tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0, 1.0])


@pytest.mark.parametrize(
    "transform,expected", [("copy", [4, 0, 7]), ("reverse", [7, 0, 4]), ("increment", [5, 1, 8]), ("sort", [0, 4, 7])]
)
def test_targets(transform, expected):
    task = DigitTask(num_digits=3, transform=transform)
    assert task.targets(torch.tensor([[4, 0, 7, SEP]])).tolist() == [expected]


def test_task_rejects_bad_arguments():
    with pytest.raises(ValueError, match="transform must be one of"):
        DigitTask(transform="rotate")
    with pytest.raises(ValueError, match="num_digits must be >= 1, got 0"):
        DigitTask(num_digits=0)


def test_grpo_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0])
    a = grpo_advantages(r, 4, eps=0.0)
    # group 1: mean .5, population std sqrt(.125); group 2: mean .25, std sqrt(3)/4
    s1, s2 = math.sqrt(0.125), math.sqrt(3) / 4
    assert a.tolist() == pytest.approx([0.5 / s1, -0.5 / s1, 0, 0, -0.25 / s2, -0.25 / s2, -0.25 / s2, 0.75 / s2])
    assert grpo_advantages(torch.ones(4), 4).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="not a whole number of groups of 3"):
        grpo_advantages(torch.ones(4), 3)


# ----------------------------------------------------------------------------------------------- engine
def test_kv_cache_decoding_matches_full_forward():
    w = random_weights()
    model = KVCacheGPT(CFG, w, dtype=torch.float32)
    tok = torch.randint(0, 16, (3, 9), generator=torch.Generator().manual_seed(1))
    full, _ = model.forward(tok, 0, None)
    logits, cache = model.forward(tok[:, :4], 0, None)
    steps = [logits]
    for t in range(4, 9):
        logits, cache = model.forward(tok[:, t : t + 1], t, cache)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def _fp32_logprobs(w, response: dict, prompt: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = [e[1] for e in response["meta_info"]["output_token_logprobs"]]
    seq = torch.tensor([prompt + ids])
    logits, _ = KVCacheGPT(CFG, w, dtype=torch.float32).forward(seq, 0, None)
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1] / temperature, -1)
    return lp.gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def test_engine_response_has_sglang_shape_and_bf16_logprobs():
    w = random_weights()
    eng = EmbeddedEngine(CFG, dtype=torch.bfloat16)
    eng.load_weights(w)
    prompt = [1, 2, 3, SEP]
    req = {
        "input_ids": [prompt] * 6,
        "return_logprob": True,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 5, "stop_token_ids": [EOS], "sampling_seed": 3},
    }
    out = eng.generate(req)
    assert isinstance(out, list) and len(out) == 6
    diffs = []
    for r in out:
        meta = r["meta_info"]
        entries = meta["output_token_logprobs"]
        assert [e[1] for e in entries] == r["output_ids"] and all(e[2] is None for e in entries)
        assert meta["completion_tokens"] == len(entries) and meta["prompt_tokens"] == 4
        if meta["finish_reason"]["type"] == "stop":
            assert r["output_ids"][-1] == EOS and EOS not in r["output_ids"][:-1]
        else:
            assert meta["finish_reason"] == {"type": "length", "length": 5} and EOS not in r["output_ids"]
        ref = _fp32_logprobs(w, r, prompt, temperature=0.7)
        got = torch.tensor([e[0] for e in entries])
        diffs.append((got - ref).abs().max())
    # bf16 decode is a different numerical path: close to fp32, but not equal
    assert 1e-4 < max(diffs) < 0.2


def test_engine_is_reproducible_with_sampling_seed_and_fp32_is_exact():
    w = random_weights()
    eng = EmbeddedEngine(CFG, dtype=torch.float32)
    eng.load_weights(w)
    req = {
        "input_ids": [[4, 5, 6, SEP]] * 8,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "stop_token_ids": [EOS], "sampling_seed": 11},
    }
    a, b = eng.generate(req), eng.generate(req)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    for r in a:
        got = torch.tensor([e[0] for e in r["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, _fp32_logprobs(w, r, [4, 5, 6, SEP]), rtol=0, atol=2e-6)


def test_engine_top_k_samples_only_top_tokens_but_reports_full_logprob():
    w = random_weights()
    eng = EmbeddedEngine(CFG, dtype=torch.float32)
    eng.load_weights(w)
    prompt = [7, 7, 7, SEP]
    req = {
        "input_ids": [prompt] * 64,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 1, "top_k": 2, "sampling_seed": 5},
    }
    out = eng.generate(req)
    logits, _ = KVCacheGPT(CFG, w, dtype=torch.float32).forward(torch.tensor([prompt]), 0, None)
    full_lp = torch.log_softmax(logits[0, -1], -1)
    top2 = set(full_lp.topk(2).indices.tolist())
    assert {r["output_ids"][0] for r in out} <= top2
    for r in out:
        lp, tid, _ = r["meta_info"]["output_token_logprobs"][0]
        assert lp == pytest.approx(float(full_lp[tid]), abs=1e-6)  # not renormalised, as SGLang


def test_engine_logit_noise_changes_the_behaviour_policy():
    w = random_weights()
    req = {
        "input_ids": [[1, 1, 1, SEP]] * 4,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 3, "sampling_seed": 2},
    }
    clean, noisy = EmbeddedEngine(CFG, dtype=torch.float32), EmbeddedEngine(CFG, dtype=torch.float32, logit_noise=1.0)
    clean.load_weights(w)
    noisy.load_weights(w)
    r = noisy.generate(req)[0]
    got = torch.tensor([e[0] for e in r["meta_info"]["output_token_logprobs"]])
    assert (got - _fp32_logprobs(w, r, [1, 1, 1, SEP])).abs().max() > 0.05
    with pytest.raises(ValueError, match="logit_noise must be >= 0, got -1"):
        EmbeddedEngine(CFG, logit_noise=-1)


def test_engine_errors():
    eng = EmbeddedEngine(CFG)
    with pytest.raises(EngineNotReadyError, match="no weights loaded"):
        eng.generate({"input_ids": [1, SEP], "return_logprob": True})
    eng.load_weights(random_weights())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        eng.generate({"input_ids": [1, SEP], "return_logprob": True, "sampling_params": {"temperature": 0}})
    with pytest.raises(ValueError, match="input_ids must be a non-empty list"):
        eng.generate({"input_ids": [], "return_logprob": True})
    with pytest.raises(ValueError, match="missing"):
        KVCacheGPT(CFG, {"transformer.wte.weight": torch.zeros(16, 32)}, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------- HTTP
def test_http_server_speaks_generate_and_update_weights_from_disk(tmp_path):
    w = random_weights()
    engine = EmbeddedEngine(CFG)
    server, url = serve(engine, weights_root=str(tmp_path))
    try:
        client = SGLangClient(url)
        client.wait_healthy(timeout=10)
        req = {
            "input_ids": [[1, 2, 3, SEP]] * 3,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "sampling_seed": 9, "stop_token_ids": [EOS]},
        }
        with pytest.raises(SGLangHTTPError, match="HTTP 503"):
            client.generate(req)
        sync = DiskWeightSync(client, str(tmp_path / "w"), CFG, EOS)
        sync.push(w, 0)
        assert engine.weight_version == 1
        over_http = client.generate(req)
        local = EmbeddedEngine(CFG)
        local.load_weights(w)
        direct = local.generate(req)
        strip = [{**r, "meta_info": {k: v for k, v in r["meta_info"].items() if k != "id"}} for r in direct]
        assert [{**r, "meta_info": {k: v for k, v in r["meta_info"].items() if k != "id"}} for r in over_http] == strip
        with pytest.raises(SGLangHTTPError, match="HTTP 400.*failed to load weights"):
            client.update_weights_from_disk(str(tmp_path / "missing"))
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="must start with http"):
        SGLangClient("127.0.0.1:1")


def test_hf_checkpoint_round_trip(tmp_path):
    w = random_weights()
    save_hf_checkpoint(str(tmp_path), w, CFG, EOS)
    cfg, back = load_hf_checkpoint(str(tmp_path))
    assert cfg == CFG and all(torch.equal(back[k], w[k]) for k in w)


def test_lagged_weight_sync_forwards_the_version_from_k_pushes_ago():
    class Recorder:
        def __init__(self):
            self.seen = []

        def push(self, weights, step):
            self.seen.append(int(weights["x"]))

    rec = Recorder()
    sync = LaggedWeightSync(rec, lag=2)
    for v in range(5):
        sync.push({"x": torch.tensor(v)}, v)
    assert rec.seen == [0, 0, 0, 1, 2]
    rec2 = Recorder()
    resumed = LaggedWeightSync(rec2, lag=2)
    resumed.load_state_dict(sync.state_dict(), 5)
    resumed.push({"x": torch.tensor(5)}, 5)
    assert rec2.seen == [2, 3]
    with pytest.raises(ValueError, match="written with --rollout-lag 2, resuming with 1"):
        LaggedWeightSync(rec2, lag=1).load_state_dict(sync.state_dict(), 5)
    with pytest.raises(ValueError, match="--rollout-lag must be >= 0"):
        LaggedWeightSync(rec2, lag=-1)


# ----------------------------------------------------------------------------------------------- batch
def _resp(ids, lps):
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": "x",
            "prompt_tokens": 4,
            "completion_tokens": len(ids),
            "finish_reason": {"type": "stop", "matched": EOS},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
        },
    }


def test_batch_layout_from_hand_written_responses():
    task = DigitTask(num_digits=3, transform="reverse")
    prompts = torch.tensor([[1, 2, 3, SEP]] * 2)
    responses = [_resp([3, 2, 1, EOS], [-0.1, -0.2, -0.3, -0.4]), _resp([3, EOS], [-1.0, -2.0])]
    b = build_batch(task, prompts, parse_responses(responses), group_size=2)
    assert b.tokens.tolist() == [[1, 2, 3, SEP, 3, 2, 1, EOS], [1, 2, 3, SEP, 3, EOS, 0, 0]]
    assert b.labels[:, :-1].tolist() == b.tokens[:, 1:].tolist()
    # position s predicts token s+1: the response starts being predicted at s = P - 1 = 3
    assert b.loss_mask.int().tolist() == [[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0, 0]]
    assert b.rollout_log_probs[0, 3:7].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert b.rollout_log_probs[1].tolist() == pytest.approx([0, 0, 0, -1.0, -2.0, 0, 0, 0])
    assert b.rewards.tolist() == pytest.approx([1.0, 1 / 3])
    assert b.advantages[:, 0].tolist() == pytest.approx([1.0, -1.0], abs=1e-4)
    assert b.sglang_rejected.tolist() == [0.0, 0.0]


def test_misaligned_response_is_rejected_not_trained_on():
    task = DigitTask(num_digits=3)
    bad = _resp([3, 2, EOS], [-0.1, -0.2, -0.3])
    bad["output_ids"] = [2, EOS, 5]  # ids disagree with output_token_logprobs (shifted)
    b = build_batch(task, torch.tensor([[1, 2, 3, SEP]] * 2), parse_responses([bad, _resp([1], [-0.5])]), 2)
    assert b.sglang_rejected.tolist() == [1.0, 0.0]
    assert not b.loss_mask[0].any() and b.loss_mask[1].sum() == 1


def test_collect_rollout_is_deterministic_per_step():
    eng = EmbeddedEngine(CFG)
    eng.load_weights(random_weights())
    task = DigitTask(num_digits=3)
    s = RolloutSettings(prompts_per_step=4, group_size=4, seed=1)
    a, b, c = collect_rollout(eng, task, s, 0), collect_rollout(eng, task, s, 0), collect_rollout(eng, task, s, 1)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert torch.equal(a.prompts[::4], a.prompts[1::4])  # group_size copies of each prompt
    req = make_request(a.prompts, task, s, 0)
    assert req["return_logprob"] and req["sampling_params"]["stop_token_ids"] == [EOS]


def test_in_process_sync_updates_engine():
    eng = EmbeddedEngine(CFG)
    InProcessWeightSync(eng).push(random_weights(), 0)
    assert eng.weight_version == 1


@pytest.mark.timeout(120)
def test_megatron_export_matches_kv_cache_decoder():
    """The megatron-core GPT (fp32, full sequence) and the engine reading its exported GPT-2 weights
    (fp32, KV cache) give the same logits: the only mismatch in training runs is the engine's dtype."""
    code = textwrap.dedent("""
        import torch, warnings; warnings.filterwarnings("ignore")
        from examples.rl.dist import init_distributed, shutdown
        from examples.rl.model import ModelConfig, build_megatron_gpt, gather_gpt2_weights, KVCacheGPT
        init_distributed(seed=3)
        cfg = ModelConfig(hidden_size=32)
        m = build_megatron_gpt(cfg)
        with torch.no_grad():  # move every parameter off its init so biases / norms are exercised
            for p in m.parameters():
                p.add_(0.05 * torch.randn_like(p))
        tok = torch.randint(0, 16, (3, 10))
        mask = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1).view(1, 1, 10, 10)
        ref = m(tok, torch.arange(10).expand(3, 10), mask)
        dec = KVCacheGPT(cfg, gather_gpt2_weights(m, cfg), dtype=torch.float32)
        logits, cache = dec.forward(tok[:, :6], 0, None)
        outs = [logits]
        for t in range(6, 10):
            logits, cache = dec.forward(tok[:, t:t + 1], t, cache)
            outs.append(logits)
        err = (torch.cat(outs, 1) - ref).abs().max().item()
        bf = KVCacheGPT(cfg, gather_gpt2_weights(m, cfg), dtype=torch.bfloat16).forward(tok, 0, None)[0]
        bf_err = (torch.log_softmax(bf, -1) - torch.log_softmax(ref, -1)).abs().max().item()
        print("ERR", err, bf_err)
        shutdown()
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    err, bf_err = map(float, out.stdout.split("ERR")[1].split())
    assert err < 1e-5
    assert 1e-4 < bf_err < 0.1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--rollout-lag", "-1"], "--rollout-lag must be >= 0, got -1"),
        (["--rollout-temperature", "0"], "--rollout-temperature must be > 0, got 0.0"),
        (
            ["--num-microbatches", "3"],
            "256 sequences must be divisible by DP size \\(2\\) x --num-microbatches \\(3\\)",
        ),
        (["--sglang-url", "http://x", "--engine-dtype", "float32"], "configure the embedded engine"),
        (["--sglang-url", "http://x", "--engine-quant", "int8"], "configure the embedded engine"),
        (["--sglang-url", "http://x", "--engine-lm-head-fp32"], "configure the embedded engine"),
    ],
)
def test_launcher_validates_arguments(argv, message):
    from examples.rl.train import build_parser, validate

    with pytest.raises(ValueError, match=message):
        validate(build_parser().parse_args(argv), world_size=2)


def test_launcher_exposes_the_plugin_flags():
    from examples.rl.train import build_parser
    from slime_tis import TISConfig

    args = build_parser().parse_args(
        ["--use-rollout-log-probs", "--use-tis", "--tis-mode", "mask", "--tis-level", "geometric"]
    )
    cfg = TISConfig.from_args(args)
    assert cfg.algorithm == 3 and cfg.mode == "mask" and cfg.level == "geometric"
    assert TISConfig.from_args(build_parser().parse_args([])).algorithm == 0


def test_checkpoint_reader_refuses_a_torch_whose_metadata_megatron_cannot_read(monkeypatch):
    """torch 2.15 added ``strides`` to ``TensorProperties``; megatron-core's dist_checkpointing passes the
    properties' ``__dict__`` to ``torch.empty`` and fails at load time. The example refuses at start-up instead,
    naming the torch version and the fix; the installed torch passes the same check."""
    import dataclasses

    import torch.distributed.checkpoint.metadata as metadata

    from examples.rl import checkpoint

    checkpoint.check_reader_compatible()  # the tested torch

    @dataclasses.dataclass
    class TensorPropertiesWithStrides(metadata.TensorProperties):
        strides: tuple = ()

    monkeypatch.setattr(metadata, "TensorProperties", TensorPropertiesWithStrides)
    with pytest.raises(RuntimeError, match=r"cannot read checkpoints back .*'strides'.*torch < 2\.15"):
        checkpoint.check_reader_compatible()
