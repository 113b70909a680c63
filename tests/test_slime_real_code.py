"""slime's real code (THUDM/slime 624b824) around the plugin, where a slime checkout is at hand.

slime cannot be installed here (its package pulls sglang, ray and Megatron-LM), so these tests import its files
from the checkout named by ``SLIME_SRC`` (``git clone https://github.com/THUDM/slime && git -C slime checkout
624b824``) and skip without it; CI has none, and there the stand-ins (tests/_slime_sim.py, tests/_slime_args.py)
carry the same checks. What they stub, none of which is checked: ``megatron.core.mpu``'s context-parallel queries
(one process, CP = 1), ``get_log_probs_and_entropy`` (a plain log-softmax of the logits: the term under test is
the reduction, not the vocab-parallel kernel), the ``slime.backends.megatron_utils`` package initialiser (accelerator
set-up), sglang's argument module, the external-engine helper and the logger set-up.

* ``policy_loss_function`` with ``--use-opsm --use-kl-loss --use-unbiased-kl --entropy-coef`` (issue 39): the TIS
  hook at truncate/token/1.3 gives slime's own ``--use-tis --tis-clip 1.3`` loss and gradient, with and without
  a custom pg-loss reducer.
* ``add_slime_arguments`` + ``slime_validate_args``: the same verdict as tests/_slime_args.py on every documented
  slime block added to each example script's batch flags.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import types
from pathlib import Path

import pytest
import torch

SLIME_SRC = os.environ.get("SLIME_SRC")
pytestmark = pytest.mark.skipif(
    not SLIME_SRC or not (Path(SLIME_SRC) / "slime/backends/megatron_utils/loss.py").is_file(),
    reason="set SLIME_SRC to a THUDM/slime checkout at 624b824 (slime cannot be installed here)")


@pytest.fixture
def real_slime(monkeypatch):
    """slime's modules from ``SLIME_SRC`` with the stubs of the module docstring; removed afterwards."""
    from megatron.core import mpu

    from slime_tis.slime.state import STATE

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")  # slime compiles its KL and PPO terms; eager is the same math
    monkeypatch.syspath_prepend(SLIME_SRC)
    monkeypatch.setattr(mpu, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(mpu, "get_context_parallel_rank", lambda: 0)
    monkeypatch.setattr(mpu, "get_context_parallel_group", lambda: None)
    before = set(sys.modules)
    stubs = {
        "slime.backends.megatron_utils": dict(__path__=[f"{SLIME_SRC}/slime/backends/megatron_utils"]),
        "slime.backends.sglang_utils.arguments": dict(sglang_parse_args=lambda: None, validate_args=lambda a: None),
        "slime.backends.sglang_utils.external": dict(apply_external_engine_info_to_args=lambda *a, **k: None),
        "slime.observability.logging_utils": dict(configure_logger=lambda *a, **k: None),
    }
    importlib.import_module("slime.observability")  # the stubs' real parents
    importlib.import_module("slime.backends")
    for name, attrs in stubs.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        parent, _, leaf = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], leaf, mod)
    STATE.clear()
    yield
    for name in [k for k in sys.modules if k not in before and (k == "slime" or k.startswith("slime."))]:
        del sys.modules[name]
    STATE.clear()


# ----------------------------------------------------------------------------- the policy loss
def _log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, **_):
    """Response log-probs and entropies of a packed CP = 1 micro-batch ``[1, sum T_i, V]``."""
    lp, ent, pos = [], [], 0
    for tok, t, r in zip(unconcat_tokens, total_lengths, response_lengths):
        logp = torch.log_softmax(logits[0, pos:pos + t].float() / args.rollout_temperature, -1)[t - r - 1:t - 1]
        lp.append(logp.gather(-1, tok[t - r:, None]).squeeze(-1))
        ent.append(-(logp.exp() * logp).sum(-1))
        pos += t
    return None, {"log_probs": lp, "entropy": ent}


def _micro_batch(seed: int, n: int = 6, vocab: int = 9):
    """Logits and a batch as slime hands its loss one (one sample per rollout): pi_old off pi_theta so OPSM
    fires, advantages of both signs within a sequence, tool tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, resps = torch.randint(2, 5, (n,), generator=g).tolist(), torch.randint(4, 10, (n,), generator=g).tolist()
    totals = [p + r for p, r in zip(prompts, resps)]
    tokens = [torch.randint(0, vocab, (t,), generator=g) for t in totals]
    logits = torch.randn(1, sum(totals), vocab, generator=g)
    masks = [torch.ones(r, dtype=torch.int32) for r in resps]
    for m in masks[::3]:
        m[1:3] = 0
    args = types.SimpleNamespace(rollout_temperature=1.0)
    theta = _log_probs_and_entropy(logits, args=args, unconcat_tokens=tokens, total_lengths=totals,
                                   response_lengths=resps)[1]["log_probs"]
    old = [x + 0.3 * torch.randn(x.shape, generator=g) + 0.1 for x in theta]
    return logits, dict(
        unconcat_tokens=tokens, total_lengths=totals, response_lengths=resps, loss_masks=masks, log_probs=old,
        rollout_log_probs=[x + 0.3 * torch.randn(x.shape, generator=g) for x in old],
        ref_log_probs=[x + 0.2 * torch.randn(x.shape, generator=g) for x in old],
        advantages=[torch.randn(r, generator=g) for r in resps],
        rollout_mask_sums=torch.tensor([float(m.sum()) for m in masks]))


def _sample_mean_reducer(total_lengths, response_lengths, masks, per_token):
    return lambda x: sum((xi * m).sum() / m.sum().clamp(min=1) for xi, m in zip(x.split(response_lengths), masks))


@pytest.mark.parametrize("reducer", [False, True])
def test_real_policy_loss_opsm_entropy_kl_as_slime_own_tis(real_slime, reducer, monkeypatch):
    """Issue 39 item 4 on slime's own ``policy_loss_function``: equal loss and logits gradient (float32, the same
    operations on the same tokens: rel 1e-6)."""
    import slime.backends.megatron_utils.loss as slime_loss
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean

    import slime_tis.slime as plugin

    monkeypatch.setattr(slime_loss, "get_log_probs_and_entropy", _log_probs_and_entropy)
    monkeypatch.setitem(sys.modules, "user_reducers", types.SimpleNamespace(mean=_sample_mean_reducer))
    flags = dict(
        use_rollout_logprobs=False, use_opsm=True, opsm_delta=1e-3, advantage_estimator="grpo", eps_clip=0.2,
        eps_clip_high=0.2, eps_clip_c=None, get_mismatch_metrics=False, use_tis=True, tis_clip=1.3, tis_clip_low=0.0,
        custom_tis_function_path=None, calculate_per_token_loss=False, entropy_coef=0.01, use_kl_loss=True,
        kl_loss_coef=0.3, kl_loss_type="low_var_kl", use_unbiased_kl=True, rollout_temperature=1.0, rollout_top_p=1.0,
        loss_type="policy_loss", kl_coef=0.0, use_routing_replay=False, log_probs_chunk_size=-1,
        custom_pg_loss_reducer_function_path="user_reducers.mean" if reducer else None)
    hook = dict(custom_tis_function_path="slime_tis.slime.compute_tis_for_slime", tis_mode="truncate",
                tis_level="token", tis_upper_bound=1.3)
    out = {}
    for name, extra in (("own", {}), ("hook", hook)):
        logits, batch = _micro_batch(0)
        args = types.SimpleNamespace(**(flags | extra))
        keys = ("loss_masks", "total_lengths", "response_lengths", "rollout_log_probs", "rollout_mask_sums",
                "advantages", "log_probs")
        plugin.postprocess_rollout_data(args, 0, {k: batch[k] for k in keys})
        logits.requires_grad_(True)
        reduce = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                        batch["rollout_mask_sums"], False)
        loss, metrics = slime_loss.policy_loss_function(args, batch, logits, reduce)
        loss.backward()
        assert float(metrics["opsm_clipfrac"]) > 0  # OPSM zeroed tokens
        out[name] = loss.detach(), logits.grad
        plugin.COLLECTOR.flush()
    torch.testing.assert_close(out["hook"][0], out["own"][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["hook"][1], out["own"][1], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- the argument checks
def test_real_argument_checks_agree_with_the_stand_in(real_slime, tmp_path):
    import slime.utils.arguments as slime_arguments
    import test_slime_command_lines as docs
    from _slime_args import EXAMPLE_SCRIPTS, FLAGS, SlimeArgsError, command_tokens, slime_accepts

    parser = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--tensor-model-parallel-size", "--context-parallel-size"):  # Megatron's own
        parser.add_argument(flag, type=int, default=1)
    parser.add_argument("--train-backend", default="megatron")  # slime's pre-parsed flags (_pre_parse_mode)
    parser.add_argument("--debug-rollout-only", action="store_true")
    parser.add_argument("--debug-train-only", action="store_true")
    parser.add_argument("--load-debug-rollout-data", default=None)
    slime_arguments.get_slime_extra_args_provider()(parser)
    assert not [f for f in FLAGS if f not in parser._option_string_actions]

    def real(text: str, base: str, yml: str | None) -> str | None:
        toks = command_tokens(base) + command_tokens(text) + ["--ref-load", str(tmp_path)]
        if "--custom-config-path" in toks:  # slime reads the file
            (tmp_path / "cfg.yaml").write_text(yml or "{}\n")
            toks[toks.index("--custom-config-path") + 1] = str(tmp_path / "cfg.yaml")
        args, unknown = parser.parse_known_args(toks)
        assert not unknown, unknown
        try:
            slime_arguments.slime_validate_args(args)
        except (AssertionError, ValueError) as e:
            return str(e)
        return None

    checked = 0
    for where, text, yml, _ in docs.COMMANDS:
        arch = re.search(r"architectures (\w+)", text)
        for script, base in EXAMPLE_SCRIPTS.items():
            assert real(text, base, yml) is None, f"{where} + {script}"
            slime_accepts(text, yaml_text=yml, base=base, architecture=arch.group(1) if arch else None)
            checked += 1
    assert checked >= 6 * 10
    qwen = EXAMPLE_SCRIPTS["scripts/run-qwen3-4B.sh"]
    refused = real("--num-steps-per-rollout 2", qwen, None)
    assert refused and "global_batch_size 256" in refused
    with pytest.raises(SlimeArgsError, match="--global-batch-size 256"):
        slime_accepts("--num-steps-per-rollout 2", base=qwen)
