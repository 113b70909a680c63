"""TISConfig validation, presets and the argparse extension."""

from __future__ import annotations

import argparse

import pytest

from slime_tis import PRESETS, TISConfig, add_tis_arguments


@pytest.mark.parametrize(
    "flags, algorithm, needs_old",
    [(dict(), 0, True), (dict(use_rollout_log_probs=True), 1, False), (dict(use_tis=True), 2, True),
     (dict(use_rollout_log_probs=True, use_tis=True), 3, False)],
)
def test_algorithm_from_two_switches(flags, algorithm, needs_old):
    cfg = TISConfig(**flags)
    assert cfg.algorithm == algorithm and cfg.needs_old_log_probs is needs_old


def test_default_bounds():
    assert (TISConfig().lower_bound, TISConfig().upper_bound) == (0.5, 2.0)
    geo = TISConfig(use_tis=True, mode="mask", level="geometric")
    assert geo.upper_bound == 1.001 and geo.lower_bound == pytest.approx(1 / 1.001)
    assert TISConfig(use_tis=True, mode="truncate", level="geometric").upper_bound == 2.0
    assert TISConfig(use_tis=True, rs_level="geometric").rs_upper_bound == 1.001
    assert TISConfig(use_tis=True, rs_level="token").rs_lower_bound == 0.5
    assert TISConfig(use_tis=True, upper=4.0).lower_bound == 0.25
    # replace() re-derives unset bounds for the new mode/level
    assert TISConfig(use_tis=True).replace(mode="mask", level="geometric").upper_bound == 1.001


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(use_tis=True, mode="maks"), r"--tis-mode \(mode\) = 'maks': must be one of truncate, clip, mask"),
        (dict(use_tis=True, level="seq"), r"--tis-level \(level\) = 'seq'"),
        (dict(use_tis=True, lower=2.0, upper=1.5), r"--tis-lower-bound \(lower\) = 2.0: must be < --tis-upper-bound"),
        (dict(use_tis=True, lower=1.2, upper=1.5), r"--tis-lower-bound \(lower\) = 1.2: bounds must include 1"),
        (dict(use_tis=True, upper=0.9), r"--tis-upper-bound \(upper\) = 0.9: bounds must include 1"),
        (dict(use_tis=True, lower=-0.1), r"--tis-lower-bound \(lower\) = -0.1: ratio bounds must be > 0"),
        (dict(use_tis=True, veto_threshold=1.5), r"--tis-veto-threshold \(veto_threshold\) = 1.5: must lie in"),
        (dict(use_tis=True, veto_threshold=0.0), r"--tis-veto-threshold .* = 0.0"),
        (dict(use_tis=True, rs_level="token", rs_lower=3.0), r"--tis-rs-lower-bound \(rs_lower\) = 3.0"),
        (dict(use_tis=True, rs_upper=3.0), r"--tis-rs-upper-bound .*--tis-rs-level is not set"),
        (dict(rs_level="sequence"), r"--tis-rs-level \(rs_level\) = 'sequence': algorithm 0"),
        (dict(veto_threshold=1e-4), r"--tis-veto-threshold .*algorithm 0"),
        (dict(mode="mask"), r"--tis-mode \(mode\) = 'mask': algorithm 0"),
        (dict(batch_normalize=True), r"--tis-batch-normalize .*algorithm 0 applies no importance weights"),
        (dict(use_rollout_log_probs=True, batch_normalize=True), r"algorithm 1 applies no importance weights"),
        (dict(use_tis=True, loss_agg="mean"), r"--tis-loss-agg \(loss_agg\) = 'mean'"),
        (dict(use_tis=True, rejected_denominator="ignore"), r"--tis-rejected-denominator"),
        (dict(eps_clip=1.0), r"--eps-clip \(eps_clip\) = 1.0"),
        (dict(dual_clip_c=1.0), r"--eps-clip-c \(dual_clip_c\) = 1.0: dual-clip constant must be > 1"),
        (dict(safety_bound=0.0), r"--tis-safety-bound \(safety_bound\) = 0.0"),
        (dict(use_tis=True, upper=float("inf")), r"--tis-upper-bound .* must be a finite number"),
        (dict(use_tis="yes"), r"--use-tis \(use_tis\) = 'yes': must be a bool"),
        (dict(kernels="auto"), r"--tis-kernels \(kernels\) = 'auto': must be one of torch, triton"),
    ],
)
def test_invalid_values_raise_naming_flag_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TISConfig(**kwargs)


def test_presets_cover_verl_eight():
    for name in ("decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs",
                 "ppo_is_bypass", "pg_is", "pg_rs", "disabled"):
        assert name in PRESETS
    assert TISConfig.from_preset("decoupled_seq_is_rs").rs_level == "sequence"
    assert TISConfig.from_preset("pg_is").algorithm == 3
    assert TISConfig.from_preset("ppo_is_bypass").algorithm == 1
    assert TISConfig.from_preset("disabled").algorithm == 0
    geo = TISConfig.from_preset("decoupled_geo_rs")
    assert (geo.algorithm, geo.mode, geo.level, geo.veto_threshold) == (2, "mask", "geometric", 1e-4)
    assert TISConfig.from_preset("decoupled_seq_is", upper=5.0).upper_bound == 5.0
    for name in PRESETS:  # every preset is valid
        TISConfig.from_preset(name)
    with pytest.raises(ValueError, match="--tis-preset = 'nope': unknown preset; choose one of"):
        TISConfig.from_preset("nope")


def parse(argv, parser=None):
    parser = add_tis_arguments(parser or argparse.ArgumentParser())
    return TISConfig.from_args(parser.parse_args(argv))


def test_flags_to_config():
    cfg = parse(["--use-tis", "--tis-mode", "clip", "--tis-level", "sequence", "--tis-upper-bound", "3",
                 "--tis-lower-bound", "0.25", "--tis-rs-level", "geometric", "--tis-veto-threshold", "1e-4",
                 "--tis-batch-normalize", "--tis-rejected-denominator", "drop", "--tis-loss-agg",
                 "seq-mean-token-mean", "--eps-clip", "0.1", "--eps-clip-high", "0.3", "--eps-clip-c", "3"])
    assert cfg == TISConfig(use_tis=True, mode="clip", level="sequence", upper=3.0, lower=0.25, rs_level="geometric",
                            veto_threshold=1e-4, batch_normalize=True, rejected_denominator="drop",
                            loss_agg="seq-mean-token-mean", eps_clip=0.1, eps_clip_high=0.3, dual_clip_c=3.0)
    assert parse([]) == TISConfig()
    assert parse(["--use-rollout-log-probs", "--use-tis"]).algorithm == 3


def test_preset_expanded_then_flags_override():
    cfg = parse(["--tis-preset", "decoupled_seq_is", "--tis-upper-bound", "4"])
    assert (cfg.algorithm, cfg.level, cfg.upper_bound) == (2, "sequence", 4.0)
    assert parse(["--tis-preset", "pg_rs", "--tis-veto-threshold", "1e-6"]).veto_threshold == 1e-6


def test_invalid_flag_values_raise_at_config_time():
    with pytest.raises(ValueError, match=r"--tis-upper-bound \(upper\) = 0.5"):
        parse(["--use-tis", "--tis-upper-bound", "0.5"])
    with pytest.raises(SystemExit):  # argparse rejects an unknown choice itself
        parse(["--tis-mode", "nope"])


def test_host_parser_that_already_defines_slime_flags():
    """slime defines --use-tis, --use-rollout-logprobs and the --eps-clip family: reuse, no conflict error."""
    host = argparse.ArgumentParser()
    host.add_argument("--use-tis", action="store_true", default=False)
    host.add_argument("--use-rollout-logprobs", action="store_true", default=False)
    host.add_argument("--eps-clip", type=float, default=0.2)
    host.add_argument("--eps-clip-high", type=float, default=None)
    host.add_argument("--eps-clip-c", type=float, default=None)
    parser = add_tis_arguments(host)
    assert parser is host
    cfg = TISConfig.from_args(parser.parse_args(["--use-rollout-logprobs", "--use-tis", "--eps-clip", "0.3"]))
    assert (cfg.algorithm, cfg.eps_clip) == (3, 0.3)
    cfg = TISConfig.from_args(parser.parse_args(["--use-rollout-log-probs"]))
    assert cfg.algorithm == 1
    add_tis_arguments(parser)  # adding twice is harmless too


def test_megatron_extra_args_provider_contract():
    from slime_tis.arguments import add_tis_arguments as provider

    parser = argparse.ArgumentParser(conflict_handler="error")
    assert provider(parser) is parser
    assert "--tis-preset" in parser.format_help()


def test_describe_prints_resolved_bounds():
    text = TISConfig.from_preset("decoupled_geo_rs").describe()
    assert "algorithm 2" in text and "lower=0.999 upper=1.001" in text and "veto" in text


def test_kernels_is_one_flag_for_every_kernel():
    """--tis-kernels -> TISConfig.kernels -> Plan.kernels; default torch (Triton opt-in until measured on a GPU)."""
    assert TISConfig().kernels == "torch" and TISConfig().plan.kernels == "torch"
    cfg = parse(["--use-tis", "--tis-kernels", "triton"])
    assert cfg.kernels == "triton" and cfg.plan.kernels == "triton"
    assert "kernels=triton" in cfg.describe() and "kernels=torch" in TISConfig().describe()
    with pytest.raises(SystemExit):
        parse(["--tis-kernels", "auto"])
