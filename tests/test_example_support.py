"""The example engine's ``return_sampling_mask`` (SGLang's shape) and the batch's supports, end to end on the CPU:
the engine samples with top-k / top-p, returns each token's support and the truncated distribution's log-prob;
the batch carries the supports; the plugin's replay over them gives back the engine's log-probs (float32 engine,
so the only difference is the KV-cache decode against the full-sequence forward: 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_example_http_faults import random_weights

from examples.rl.batch import support_csr
from examples.rl.model import KVCacheGPT, ModelConfig
from examples.rl.rollout import RolloutSettings, collect_rollout
from examples.rl.rollout_engine import EmbeddedEngine
from examples.rl.task import DigitTask
from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy

CFG = ModelConfig(vocab_size=32, num_layers=1, hidden_size=16, num_heads=2, max_seq_len=16)


def _setup():
    weights = random_weights(CFG, seed=3)
    weights["transformer.ln_f.weight"] = weights["transformer.ln_f.weight"] * 3   # peaked distributions
    engine = EmbeddedEngine(CFG, dtype=torch.float32)
    engine.load_weights(weights)
    return engine, KVCacheGPT(CFG, weights, dtype=torch.float32)


@pytest.mark.parametrize("top_p, top_k", [(0.7, -1), (1.0, 5), (0.8, 6), (1.0, -1)])
def test_engine_support_and_sampling_log_probs_replay_exactly(top_p, top_k):
    engine, reference = _setup()
    task = DigitTask()
    s = RolloutSettings(prompts_per_step=4, group_size=4, top_p=top_p, top_k=top_k, support_vocab_size=CFG.vocab_size)
    batch = collect_rollout(engine, task, s, step=0)
    assert batch.sglang_rejected.sum() == 0
    ids, offsets = support_csr(batch)
    lengths = offsets[1:] - offsets[:-1]
    mask = batch.loss_mask.reshape(-1)
    assert (lengths[~mask] == 0).all() and (lengths[mask] > 0).all()
    if top_k > 0:
        assert lengths.max() <= top_k
    if top_p == 1.0 and top_k < 0:
        assert (lengths[mask] == CFG.vocab_size).all()
    logits, _ = reference.forward(batch.tokens, 0, None)
    flat, labels = logits.reshape(-1, CFG.vocab_size), batch.labels.reshape(-1)
    replay, _ = vocab_parallel_log_probs_and_entropy(flat, labels, tp_group=None, row_mask=mask, with_entropy=False,
                                                     support=(ids, offsets))
    full, _ = vocab_parallel_log_probs_and_entropy(flat, labels, tp_group=None, row_mask=mask, with_entropy=False)
    rollout = batch.rollout_log_probs.reshape(-1)
    assert (replay - rollout)[mask].abs().max() < 1e-5          # pi_rollout: the truncated distribution's
    kept_mass = (full - replay)[mask].exp()
    if top_p < 1.0 or top_k > 0:
        assert kept_mass.min() < 0.999                           # the truncation bites: full would be biased
    assert kept_mass.max() <= 1 + 1e-5


def test_engine_rejects_a_non_bool_return_sampling_mask():
    engine, _ = _setup()
    req = {"input_ids": [1, 2, 3], "return_logprob": True, "return_sampling_mask": "yes",
           "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(ValueError, match="return_sampling_mask must be true or false, got 'yes'"):
        engine.generate(req)


def test_engine_sampling_fields_have_sglang_shape():
    engine, _ = _setup()
    req = {"input_ids": [1, 2, 3], "return_logprob": True, "return_sampling_mask": True,
           "sampling_params": {"max_new_tokens": 3, "top_k": 4, "sampling_seed": 5}}
    meta = engine.generate(req)["meta_info"]
    n = meta["completion_tokens"]
    assert meta["output_token_sampling_mask_length"] == n == len(meta["output_token_sampling_mask"])
    for (lp_full, tok, _), row, lp in zip(meta["output_token_logprobs"], meta["output_token_sampling_mask"],
                                          meta["output_token_sampling_logprobs"]):
        assert tok in row and len(row) <= 4 and row == sorted(row)
        assert lp >= lp_full and lp <= 0 and math.isfinite(lp)


@pytest.mark.parametrize("argv, message", [
    (["--tis-sampling-support", "replay"], "--tis-sampling-support replay replays the support a truncated rollout"),
    (["--tis-sampling-support", "replay", "--rollout-top-k", "16"], "keep the whole vocabulary of 16"),
    (["--vocab-size", "8"], "--vocab-size must be >= 16"),
])
def test_launcher_refuses_a_replay_without_truncation(argv, message):
    from examples.rl.train import build_parser, validate

    with pytest.raises(ValueError, match=message):
        validate(build_parser().parse_args(argv), 1)
    validate(build_parser().parse_args(["--tis-sampling-support", "replay", "--rollout-top-k", "5"]), 1)
