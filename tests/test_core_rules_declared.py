"""Rejection thresholds are declared once (on their ``TISConfig`` field, ``slime_tis.config_fields.threshold``) and a
rule is one row of ``core.rules.RULES``: the flag, help, validation, error message, ``describe()`` line,
``from_args`` dest, ``Plan`` value, keep mask and metric all follow from those two places.

The last test counts the files of the package that name each threshold rule: ``config.py`` (its declaration),
``core/rules.py`` (its row) and ``presets.py`` (an optional preset), nothing else.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest
import torch

from slime_tis import TISConfig, add_tis_arguments, compute_tis
from slime_tis.config import DESTS_OF, FLAG_OF, THRESHOLDS
from slime_tis.config_fields import RANGES, Option
from slime_tis.core.rules import RULES, active

THRESHOLD_RULES = [rule for rule in RULES if rule.threshold is not None and rule.rejects]
#: rows that only count (a diagnostic of a threshold, e.g. the tokens the veto tests), on while the threshold is set
THRESHOLD_COUNTERS = [rule for rule in RULES if rule.threshold is not None and not rule.rejects]
PACKAGE = Path(__file__).resolve().parent.parent / "slime_tis"


def valid_value(declared: Option) -> float:
    """A value inside every declared range: 0.5, or 1.5 for a range above 1."""
    return 1.5 if declared.valid in ("> 1", ">= 1") else 0.5


def parser() -> argparse.ArgumentParser:
    return add_tis_arguments(argparse.ArgumentParser())


def test_rule_rows_and_threshold_declarations_match():
    """Every threshold row names a declared field, every declared threshold drives exactly one row."""
    assert {rule.threshold for rule in THRESHOLD_RULES} == set(THRESHOLDS)
    assert len(THRESHOLD_RULES) == len(THRESHOLDS)  # one rejecting row per declared threshold, none shared
    assert all(rule.metric.startswith("tis/") for rule in THRESHOLD_RULES + THRESHOLD_COUNTERS)
    assert {rule.threshold for rule in THRESHOLD_COUNTERS} <= set(THRESHOLDS)
    assert len({rule.key for rule in RULES}) == len({rule.metric for rule in RULES}) == len(RULES)


@pytest.mark.parametrize("rule", THRESHOLD_RULES, ids=lambda r: r.threshold)
def test_flag_help_and_dest_generated_from_the_declaration(rule):
    declared = THRESHOLDS[rule.threshold]
    assert FLAG_OF[rule.threshold] == declared.flag and DESTS_OF[rule.threshold][0] == declared.dest
    actions = {a.dest: a for a in parser()._actions}
    action = actions[declared.dest]
    assert action.option_strings == [declared.flag] and action.help == declared.help and action.default is None
    assert declared.help.endswith("Default: off.")
    value = 1.25 if declared.valid in ("> 1", ">= 1") else 0.25
    cfg = TISConfig.from_args(parser().parse_args(["--use-tis", declared.flag, str(value)]))
    assert getattr(cfg, rule.threshold) == value
    assert cfg.rejects


@pytest.mark.parametrize("rule", THRESHOLD_RULES, ids=lambda r: r.threshold)
def test_validation_generated_from_the_declaration(rule):
    declared = THRESHOLDS[rule.threshold]
    ok, words = RANGES[declared.valid]
    bad = [v for v in (-1.0, 0.0, 1.0, 3.0) if not ok(v)] + [float("nan"), float("inf")]
    for value in bad:
        with pytest.raises(ValueError, match=rf"{declared.flag} \({rule.threshold}\) = {value!r}"):
            TISConfig(use_tis=True, **{rule.threshold: value})
    with pytest.raises(ValueError, match=rf"{declared.flag} \({rule.threshold}\) = -1.0: {re.escape(words)}"):
        TISConfig(use_tis=True, **{rule.threshold: -1.0})
    with pytest.raises(ValueError, match=rf"{declared.flag} .*algorithm 0"):
        TISConfig(**{rule.threshold: valid_value(declared)})
    with pytest.raises(ValueError, match=declared.flag):
        TISConfig.from_args(parser().parse_args(["--use-tis", declared.flag, "-2"]))


@pytest.mark.parametrize("rule", THRESHOLD_RULES, ids=lambda r: r.threshold)
def test_describe_plan_and_metric_follow_the_row(rule):
    """Value 0.5 (1.5 for a range above 1) is valid for every declared range. One sequence holds two catastrophic
    tokens (l = -15 at q = e^-1: r ~ 3e-7 < 0.5, k2 = 112.5 and k3 ~ 14, binary KL ~ 4.7; and l = +15 at
    q = e^-16: r ~ 3e6 > 1.5, binary KL ~ 4.4), so every statistic of it exceeds the value; the other is on-policy
    (l = 0). A sequence-level row rejects the first sequence (1 of 2), a token-level row those tokens (2 of 8)."""
    declared = THRESHOLDS[rule.threshold]
    value = valid_value(declared)
    cfg = TISConfig(use_rollout_log_probs=True, **{rule.threshold: value})
    assert declared.describe.format(value=value) in cfg.describe()
    assert cfg.plan.threshold(rule.threshold) == value
    assert rule in [r for r, _ in active(cfg.plan)]
    off = TISConfig(use_rollout_log_probs=True)
    assert off.plan.threshold(rule.threshold) is None and rule not in [r for r, _ in active(off.plan)]
    assert declared.describe.format(value=value) not in off.describe()

    on, without = two_sequences(cfg), two_sequences(off)
    token_level = rule.level(cfg.plan) == "token"
    expected = [True, False, False] + [True] * 5 if token_level else [False] * 4 + [True] * 4
    assert on.keep_mask.tolist() == expected and bool(without.keep_mask.all())
    assert float(on.stats.finalize()[rule.metric]) == pytest.approx(2 / 8 if token_level else 0.5)
    assert rule.metric not in without.stats.finalize()  # the metric keys follow the configuration


def two_sequences(cfg: TISConfig):
    lp_rollout = torch.tensor([-1.0, -1.0, -16.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    l = torch.tensor([0.0, -15.0, 15.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # noqa: E741
    return compute_tis(cfg, lp_rollout + l, lp_rollout, torch.ones(8, dtype=torch.bool), torch.tensor([0, 4, 8]))


def test_threshold_declaration_rejects_an_unknown_range():
    with pytest.raises(ValueError, match="valid = '=> 0'"):
        Option(flag="--tis-x-threshold", valid="=> 0", help="x. Default: off.", describe="x {value:g}")
    assert Option(flag="--tis-x-threshold", valid="> 0", help="", describe="").dest == "tis_x_threshold"
    assert math.isclose(TISConfig(use_tis=True, veto_threshold=1e-4).plan.threshold("veto_threshold"), 1e-4)


#: the veto predates the table: the offline diagnosis recommends it and slime's mis.yaml translation sets it
OLDER_NAMES = {"veto_threshold"}


@pytest.mark.parametrize("rule", [r for r in THRESHOLD_RULES if r.threshold not in OLDER_NAMES],
                         ids=lambda r: r.threshold)
def test_a_threshold_rule_lives_in_two_files_plus_its_preset(rule):
    """A threshold rule is named by the package in config.py (its field declaration) and core/rules.py (its row),
    plus presets.py where a preset sets it: no flag list, plan field or adapter copy. Searched: the field, its
    flag, and its option name (the field without ``_threshold``, e.g. verl's ``seq_mean_k3``)."""
    declared = THRESHOLDS[rule.threshold]
    names = (rule.threshold, declared.flag.removeprefix("--"), rule.threshold.removesuffix("_threshold"))
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if any(n in p.read_text() for n in names)}
    searched = {"core/search.py"} if rule.searched else set()  # a searched row's search (core.search)
    assert {"config.py", "core/rules.py"} <= files <= {"config.py", "core/rules.py", "presets.py", *searched}
