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
        (dict(dual_clip_c=1.0), r"--eps-clip-c \(dual_clip_c\) = 1.0: must be > 1 \(the dual-clip constant\)"),
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
    """--tis-kernels -> TISConfig.kernels -> the core's token pass (``Plan.token_pass``: ``None`` is the torch code);
    default torch (Triton opt-in until measured on a GPU)."""
    from slime_tis.kernels.token_pass import triton_token_pass

    assert TISConfig().kernels == "torch" and TISConfig().plan.token_pass is None
    cfg = parse(["--use-tis", "--tis-kernels", "triton"])
    assert cfg.kernels == "triton" and cfg.plan.token_pass is triton_token_pass
    assert "kernels=triton" in cfg.describe() and "kernels=torch" in TISConfig().describe()
    with pytest.raises(SystemExit):
        parse(["--tis-kernels", "auto"])


# ------------------------------------------------------------------ every field declared once
def test_every_field_declared_once_and_every_flag_generated():
    """Each ``TISConfig`` field carries one ``Option``; the parser's flags, dests and help are those declarations."""
    import dataclasses

    from slime_tis.config import ALL_OPTIONS, DESTS_OF, FLAG_OF, OPTIONS

    assert list(OPTIONS) == [f.name for f in dataclasses.fields(TISConfig)]
    assert set(FLAG_OF) == set(DESTS_OF) == set(OPTIONS)
    parser = add_tis_arguments(argparse.ArgumentParser())
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert list(actions) == [o.dest for o in ALL_OPTIONS]
    for declared in ALL_OPTIONS:
        action = actions[declared.dest]
        assert action.option_strings == [declared.flag, *declared.aliases] and action.default is None
        assert action.help == declared.help and "Default:" in (declared.readme or declared.help)
        assert action.choices == (list(declared.choices) if declared.choices else None)


def test_per_field_validation_is_generated_from_the_declaration():
    """Every declared range refuses a value outside it with ``FLAG (field) = value: words``; every number refuses
    NaN and every choice an unknown value, naming the flag."""
    import math
    import re

    from slime_tis.config import OPTIONS
    from slime_tis.config_fields import RANGES

    ranged = {f: o for f, o in OPTIONS.items() if o.valid is not None}
    assert {"eps_clip", "eps_clip_high", "dual_clip_c", "safety_bound", "veto_threshold"} <= set(ranged)
    for field, declared in ranged.items():
        ok, words = RANGES[declared.valid]
        bad = next(v for v in (-1.0, 0.0, 1.0, 1e9) if not ok(v))
        with pytest.raises(ValueError, match=rf"^{declared.flag} \({field}\) = {bad!r}: "
                                             rf"{re.escape(words)}"):
            TISConfig(use_tis=True, **{field: bad})
    for field, declared in OPTIONS.items():
        if declared.kind == "number":
            with pytest.raises(ValueError, match=rf"^{declared.flag} \({field}\) = nan: must be a finite number"):
                TISConfig(use_tis=True, **{field: math.nan})
        if declared.kind == "choice":
            with pytest.raises(ValueError, match=rf"^{declared.flag} \({field}\) = 'nope': must be one of "
                                                 rf"{re.escape(', '.join(declared.choices))}"):
                TISConfig(use_tis=True, **{field: "nope"})


def test_readme_flag_table_is_the_generated_one():
    """docs/reference.md's flag table is ``flag_table`` of the declarations
    (``python scripts/reference_tables.py --write`` regenerates it), so a flag or help text changes in one place."""
    from pathlib import Path

    from slime_tis.config import ALL_OPTIONS
    from slime_tis.config_fields import flag_table

    readme = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    table = flag_table(ALL_OPTIONS)
    start = readme.index("| flag | meaning and default |")
    assert readme[start:start + len(table)] == table
    assert not readme[start + len(table):].startswith("|"), "docs/reference.md has flag rows the declarations lack"
