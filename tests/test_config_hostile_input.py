"""Hostile configuration values: each is refused with a ``ValueError`` naming its flag (or key) and value, or
handled, never a NaN loss, an overflowing gradient, a ``ZeroDivisionError`` or a switch silently turned on.

* ``--tis-safety-bound`` must keep ``exp(B)`` finite in float32 (``exp(88.7)`` is its largest value);
* an upper bound of 0 (``1 / upper`` is the default lower bound) is an invalid bound, in the config and in
  ``slime-tis diagnose``;
* a float16 ``lp_theta`` would receive a float16 gradient of up to ``|A| exp(B) / D`` per token;
* a switch given as a string (a quoted YAML value) is parsed strictly: ``"false"`` is off, ``"flase"`` an error;
* ``slime-tis diagnose --tis-mode clip`` without ``--use-tis`` would report its default configuration instead.
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest
import torch

from slime_tis import TISConfig, policy_loss
from slime_tis.arguments import add_tis_arguments
from slime_tis.cli import main as cli_main
from slime_tis.config import MAX_SAFETY_BOUND, config_fields_from_args, parse_switch
from slime_tis.slime.config import slime_view, tis_config_from_slime_args
from slime_tis.tools.dump import write_logprob_dump


def _parse(argv: list[str]) -> TISConfig:
    return TISConfig.from_args(add_tis_arguments(argparse.ArgumentParser()).parse_args(argv))


def _extreme_loss(cfg: TISConfig, log_ratio: float, dtype=torch.float32):
    """One sequence of 4 tokens whose first has ``lp_theta - lp_old = log_ratio`` and a negative advantage (the
    unclipped PPO side: loss and gradient grow with the ratio); ``lp_rollout = lp_old`` (w = 1).
    Returns ``(loss, d loss / d lp_theta)``."""
    theta = torch.tensor([0.0, -1.0, -2.0, -3.0], dtype=dtype, requires_grad=True)
    old = torch.tensor([-log_ratio, -1.0, -2.0, -3.0])
    adv = torch.tensor([-1.0, 1.0, 1.0, 1.0])
    out = policy_loss(cfg, theta, old, old.clone(), adv, torch.ones(4), torch.tensor([0, 4]))
    out.loss.backward()
    return out.loss.detach(), theta.grad


# ------------------------------------------------------------------------------------------------ safety bound
@pytest.mark.parametrize("bound", [89.0, 100.0, 1e4, MAX_SAFETY_BOUND + 0.5])
def test_safety_bound_that_overflows_float32_exp_is_refused(bound):
    with pytest.raises(ValueError, match=r"--tis-safety-bound \(safety_bound\) = .*must lie in \(0, 60\]"):
        TISConfig(use_tis=True, safety_bound=bound)
    with pytest.raises(ValueError, match="--tis-safety-bound"):
        _parse(["--use-tis", "--tis-safety-bound", str(bound)])


@pytest.mark.parametrize("use_tis", [False, True])
@pytest.mark.parametrize("log_ratio", [MAX_SAFETY_BOUND - 1.0, 100.0])
def test_largest_safety_bound_keeps_loss_and_gradient_finite(use_tis, log_ratio):
    """Token 0: loss -A rho / D with rho = exp(min(l, B)), D = 4; gradient rho / D inside the clamp, 0 beyond it.
    The other three tokens: rho = 1 (not clipped), loss -A / D each."""
    cfg = TISConfig(use_tis=use_tis, safety_bound=MAX_SAFETY_BOUND)
    loss, grad = _extreme_loss(cfg, log_ratio)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    rho = math.exp(min(log_ratio, MAX_SAFETY_BOUND))
    assert float(loss) == pytest.approx(rho / 4 - 3 / 4, rel=1e-6)  # float32 exp: ~1e-7 relative
    assert float(grad[0]) == pytest.approx(rho / 4 if log_ratio < MAX_SAFETY_BOUND else 0.0, rel=1e-6)


# ------------------------------------------------------------------------------------------------ upper bound 0
@pytest.mark.parametrize("fields, flag", [
    (dict(use_tis=True, upper=0.0), "--tis-upper-bound"),
    (dict(use_tis=True, upper=-0.0), "--tis-upper-bound"),
    (dict(use_tis=True, rs_level="token", rs_upper=0.0), "--tis-rs-upper-bound"),
])
def test_zero_upper_bound_is_a_named_error(fields, flag):
    with pytest.raises(ValueError, match=rf"{flag} \(\w+\) = -?0\.0: bounds must include 1"):
        TISConfig(**fields)


def test_diagnose_zero_upper_bound_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    write_logprob_dump(path, [{"train_log_probs": torch.tensor([-1.0, -2.0]),
                               "rollout_log_probs": torch.tensor([-1.1, -2.0]), "loss_mask": torch.ones(2)}])
    assert cli_main(["diagnose", str(path), "--no-png", "--use-tis", "--tis-upper-bound", "0"]) == 2
    assert "--tis-upper-bound (upper) = 0.0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ float16
def test_float16_lp_theta_is_refused():
    """With the default B = 20 the gradient at a token with l = 19 is exp(19) / 4 = 4.5e7: inf in float16."""
    with pytest.raises(ValueError, match="lp_theta is float16.*65504.*float32"):
        _extreme_loss(TISConfig(), 19.0, dtype=torch.float16)


def test_bfloat16_lp_theta_gets_a_finite_gradient():
    """bfloat16 has float32's range: the same token's gradient stays finite."""
    _, grad = _extreme_loss(TISConfig(), 19.0, dtype=torch.bfloat16)
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()
    assert float(grad[0]) == pytest.approx(math.exp(19.0) / 4, rel=2 ** -7)  # bfloat16: 8 significant bits


# ------------------------------------------------------------------------------------------------ switches
@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), (1, True), (0, False), ("true", True), ("False", False), (" yes ", True),
    ("no", False), ("on", True), ("OFF", False), ("1", True), ("0", False),
])
def test_switch_values_parse_strictly(value, expected):
    assert parse_switch("x", value) is expected


@pytest.mark.parametrize("value", ["flase", "", "2", 2, -1, 0.0, 1.0, []])
def test_malformed_switch_is_a_named_error(value):
    with pytest.raises(ValueError, match=r"--tis-batch-normalize \(tis_batch_normalize\) = .*expected a boolean"):
        config_fields_from_args(SimpleNamespace(use_tis=True, tis_batch_normalize=value))


def _slime_args(**yaml_keys) -> SimpleNamespace:
    """slime's namespace after ``--custom-config-path``: its own flags, then the YAML keys as they were written."""
    return SimpleNamespace(use_tis=True, use_rollout_logprobs=False, calculate_per_token_loss=False, eps_clip=0.2,
                           eps_clip_high=None, eps_clip_c=None, **yaml_keys)


def test_quoted_yaml_false_leaves_switches_off():
    cfg = tis_config_from_slime_args(_slime_args(tis_batch_normalize="false"))
    assert cfg.batch_normalize is False
    assert tis_config_from_slime_args(_slime_args(tis_batch_normalize="true")).batch_normalize is True
    # mis.py's use_rs: "false" must not turn rejection sampling on
    cfg = tis_config_from_slime_args(_slime_args(use_rs="false", rs_level="sequence"))
    assert cfg.rs_level is None
    assert tis_config_from_slime_args(_slime_args(use_rs="true", rs_level="sequence")).rs_level == "sequence"
    assert slime_view(SimpleNamespace(tis_record_train_log_probs="false")).recording is False
    assert slime_view(SimpleNamespace(tis_record_train_log_probs="yes")).recording is True
    with pytest.raises(ValueError, match="use_rs = 'ture'"):
        tis_config_from_slime_args(_slime_args(use_rs="ture", rs_level="sequence"))
    with pytest.raises(ValueError, match="tis_record_train_log_probs = 'nope'"):
        slime_view(SimpleNamespace(tis_record_train_log_probs="nope"))


# ------------------------------------------------------------------------------------------------ diagnose
def test_diagnose_reads_options_as_the_host_does(tmp_path, capsys):
    """diagnose evaluates the configuration as ``TISConfig.from_args`` builds it: options that configuration
    ignores are named (the same line a host logs at start-up), never refused by one and accepted by the other,
    and never silently turned into algorithm 2; what TISConfig refuses, diagnose refuses."""
    path = tmp_path / "d.jsonl"
    write_logprob_dump(path, [{"train_log_probs": torch.tensor([-1.0, -2.0, -0.5]),
                               "rollout_log_probs": torch.tensor([-1.1, -2.0, -0.4]), "loss_mask": torch.ones(3)}])
    inert = TISConfig(level="sequence").inert_options()
    assert inert and "--tis-level sequence" in inert[0]
    assert cli_main(["diagnose", str(path), "--no-png", "--tis-level", "sequence"]) == 0
    out = capsys.readouterr().out
    assert "algorithm 0" in out and f"warning: {inert[0]}" in out
    assert cli_main(["diagnose", str(path), "--no-png", "--tis-preset", "disabled"]) == 0
    out = capsys.readouterr().out
    assert "algorithm 0" in out and "algorithm 2" not in out.split("recommendation:")[0]
    assert "rejects nothing" in out
    # TISConfig refuses mask mode under algorithm 0; so does diagnose, in one line naming the flag
    with pytest.raises(ValueError, match="--tis-mode"):
        TISConfig(mode="mask")
    assert cli_main(["diagnose", str(path), "--no-png", "--tis-mode", "mask"]) == 2
    assert "--tis-mode (mode) = 'mask'" in capsys.readouterr().err
    assert cli_main(["diagnose", str(path), "--no-png", "--use-tis", "--tis-mode", "clip"]) == 0
    assert "mode=clip" in capsys.readouterr().out
    assert cli_main(["diagnose", str(path), "--no-png"]) == 0  # no option: the default report
