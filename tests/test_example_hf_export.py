"""The weights pushed to the rollout engine are a real Hugging Face checkpoint: ``transformers``'
``GPT2LMHeadModel`` loads the exported directory (config.json + model.safetensors) and gives the engine's
logits and log-probs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_example_rl import CFG, random_weights

from examples.rl.model import WEIGHTS_FILE, KVCacheGPT, save_hf_checkpoint
from examples.rl.rollout_engine import EmbeddedEngine
from examples.rl.task import EOS, SEP

transformers = pytest.importorskip("transformers", reason="install the test extras: pip install -e '.[test]'")


def _export(tmp_path, seed: int = 0) -> tuple[str, dict[str, torch.Tensor]]:
    w = random_weights(seed=seed)
    d = str(tmp_path / "engine_weights")
    save_hf_checkpoint(d, w, CFG, EOS)
    return d, w


def test_exported_directory_is_safetensors_and_a_gpt2_config(tmp_path):
    d, w = _export(tmp_path)
    assert sorted(os.listdir(d)) == ["config.json", WEIGHTS_FILE]
    from safetensors import safe_open

    with safe_open(os.path.join(d, WEIGHTS_FILE), framework="pt") as f:
        assert set(f.keys()) == set(w)  # lm_head is tied, not stored
        assert f.metadata() == {"format": "pt"}
        torch.testing.assert_close(
            f.get_tensor("transformer.h.1.mlp.c_fc.weight"), w["transformer.h.1.mlp.c_fc.weight"]
        )
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "gpt2" and cfg["tie_word_embeddings"] and cfg["n_embd"] == CFG.hidden_size


def test_transformers_gpt2_loads_the_export_and_matches_the_engine_logits(tmp_path):
    d, _ = _export(tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(d, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied, as exported
    eng = EmbeddedEngine(CFG, dtype=torch.float32)
    assert eng.update_weights_from_disk(d)["success"]
    tok = torch.randint(0, CFG.vocab_size, (3, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(input_ids=tok).logits
    ours = KVCacheGPT(CFG, dict(hf.state_dict()), dtype=torch.float32).forward(tok, 0, None)[0]
    # float32 both sides, different kernels (sdpa vs explicit softmax): summation-order differences only
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # the engine serving that directory reports log-probs equal to the HF model's for what it sampled
    prompt = [3, 1, 4, SEP]
    sp = {"max_new_tokens": 6, "stop_token_ids": [EOS], "sampling_seed": 9}
    out = eng.generate({"input_ids": [prompt] * 4, "return_logprob": True, "sampling_params": sp})
    for r in out:
        ids = r["output_ids"]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        got = torch.tensor([e[0] for e in r["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    # and the default bf16 engine stays within bf16 rounding of the HF float32 logits
    bf = KVCacheGPT(CFG, dict(hf.state_dict()), dtype=torch.bfloat16).forward(tok, 0, None)[0]
    err = (torch.log_softmax(bf, -1) - torch.log_softmax(ref, -1)).abs().max()
    assert 1e-4 < err < 0.2
