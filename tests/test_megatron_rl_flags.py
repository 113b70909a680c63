"""Every mapped flag pair of the Megatron-LM RL host (``slime_tis/megatron_rl/flags.py``) honoured or refused in one
line naming what the user typed, on a parser holding Megatron-LM's RL flags the way ``train_rl.py``'s does (the
plugin's flags added by the launcher's ``add_megatron_rl_tis_arguments``).

``megatron_lm_parser`` declares the six Megatron-LM flags the mapping reads exactly as Megatron-LM d98e8a64dd's
``megatron/training/arguments.py`` does (names, types, defaults, actions); ``test_the_parser_declares_the_flags_as_
megatron_lm_does`` checks that against the tree where it is found (``tests/_megatron_lm_tree.py``). The whole
launch, with ``--eps-clip 0.2 --tis-kl-coef 0``, runs on the real tree in tests/dist/test_megatron_rl_real_tree.py.
"""

from __future__ import annotations

import argparse
import ast
import tarfile

import pytest
from _megatron_lm_tree import MISSING, TARBALL

from slime_tis.megatron_rl import add_megatron_rl_tis_arguments
from slime_tis.megatron_rl.flags import resolve_megatron_rl_flags

#: (flag, add_argument keywords) as in Megatron-LM d98e8a64dd's arguments.py (_add_rl_args)
MEGATRON_LM_FLAGS = (
    ("--grpo-clamp-eps-lower", dict(type=float, default=0.01)),
    ("--grpo-clamp-eps-upper", dict(type=float, default=0.01)),
    ("--grpo-kl-beta", dict(type=float, default=0.001)),
    ("--grpo-entropy-term-weight", dict(type=float, default=0.0)),
    ("--rl-inference-logprobs-is-correction", dict(action=argparse.BooleanOptionalAction, type=bool, default=False)),
    ("--rl-importance-sampling-truncation-coef", dict(type=float, default=None)),
)
#: (Megatron-LM flag, the plugin's flag, TISConfig attribute, Megatron-LM's default)
PAIRS = [("--grpo-clamp-eps-lower", "--eps-clip", "eps_clip", 0.01),
         ("--grpo-clamp-eps-upper", "--eps-clip-high", "eps_high", 0.01),
         ("--grpo-kl-beta", "--tis-kl-coef", "kl_coef", 0.001),
         ("--grpo-entropy-term-weight", "--tis-entropy-coef", "entropy_coef", 0.0)]
BASE = ["--use-tis", "--tis-upper-bound", "2"]


def megatron_lm_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for flag, kw in MEGATRON_LM_FLAGS:
        parser.add_argument(flag, **kw)
    return add_megatron_rl_tis_arguments(parser)


def resolve(argv: list[str]):
    return resolve_megatron_rl_flags(megatron_lm_parser().parse_args(argv))


def refusal(argv: list[str]) -> str:
    with pytest.raises(ValueError) as e:
        resolve(argv)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.skipif(not TARBALL.is_file(), reason=MISSING)
def test_the_parser_declares_the_flags_as_megatron_lm_does() -> None:
    with tarfile.open(TARBALL) as archive:
        source = archive.extractfile("./megatron/training/arguments.py").read().decode()
    declared = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant):
            declared[node.args[0].value] = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg != "help"}
    for flag, kw in MEGATRON_LM_FLAGS:
        want = {k: (f"argparse.{v.__name__}" if k == "action" else v.__name__ if isinstance(v, type) else repr(v))
                for k, v in kw.items()}
        assert declared[flag] == want, flag


@pytest.mark.parametrize("theirs,ours,attr,default", PAIRS, ids=[p[1] for p in PAIRS])
def test_each_pair_takes_the_typed_flag_and_megatron_lms_default_when_neither(theirs, ours, attr, default) -> None:
    """Only the plugin's flag typed (``0`` too: ``--tis-kl-coef 0`` turns the KL term off): its value; only
    Megatron-LM's: its value; both, equal: that value; neither: Megatron-LM's default."""
    for value in ("0.3", "0"):
        assert getattr(resolve([*BASE, ours, value]).cfg, attr) == float(value), (ours, value)
        assert getattr(resolve([*BASE, theirs, value]).cfg, attr) == float(value), (theirs, value)
        assert getattr(resolve([*BASE, theirs, value, ours, value]).cfg, attr) == float(value)
    assert getattr(resolve(BASE).cfg, attr) == default


@pytest.mark.parametrize("theirs,ours,attr,default", PAIRS, ids=[p[1] for p in PAIRS])
def test_each_pair_typed_with_two_values_is_refused_naming_both(theirs, ours, attr, default) -> None:
    message = refusal([*BASE, ours, "0.25", theirs, "0.3"])
    assert message.startswith(f"{theirs} 0.3 conflicts with {ours} 0.25: "), message


@pytest.mark.parametrize("typed,value", [(["--eps-clip", "0.3"], 0.3),
                                         (["--eps-clip", "0.3", "--eps-clip-high", "0.4"], 0.4),
                                         (["--grpo-clamp-eps-lower", "0.3"], 0.01),
                                         (["--eps-clip", "0.3", "--grpo-clamp-eps-upper", "0.28"], 0.28)])
def test_the_upper_clip_follows_a_typed_eps_clip(typed, value) -> None:
    """``--eps-clip`` alone is the plugin's symmetric range; Megatron-LM's lower bound alone keeps its upper
    default (as ``train_rl.py`` trains)."""
    assert resolve([*BASE, *typed]).cfg.eps_high == value


def test_an_explicit_eps_clip_is_not_refused_against_a_default_it_never_typed() -> None:
    cfg = resolve(["--use-tis", "--eps-clip", "0.2", "--rl-importance-sampling-truncation-coef", "2"]).cfg
    assert (cfg.eps_clip, cfg.eps_high, cfg.upper_bound, cfg.kl_coef) == (0.2, 0.2, 2.0, 0.001)


def test_the_entropy_estimate_follows_the_flag_that_set_the_coefficient() -> None:
    """Megatron-LM's ``--grpo-entropy-term-weight`` alone: its sampled-token estimate; the plugin's
    ``--tis-entropy-coef`` (alone, or agreeing with it): the distribution's entropy."""
    assert resolve([*BASE, "--grpo-entropy-term-weight", "0.01"]).sampled_entropy
    assert not resolve([*BASE, "--tis-entropy-coef", "0.01"]).sampled_entropy
    assert not resolve([*BASE, "--tis-entropy-coef", "0.01", "--grpo-entropy-term-weight", "0.01"]).sampled_entropy
    assert not resolve(BASE).sampled_entropy


def test_the_kl_estimator_against_a_typed_kl_beta() -> None:
    assert refusal(["--use-tis", "--tis-upper-bound", "2", "--grpo-kl-beta", "0.05", "--tis-kl-estimator", "k2"]) \
        .startswith("--grpo-kl-beta 0.05 (the k3 estimator) conflicts with --tis-kl-estimator k2: ")
    cfg = resolve([*BASE, "--tis-kl-coef", "0.05", "--tis-kl-estimator", "k2"]).cfg
    assert (cfg.kl_coef, cfg.kl_estimator) == (0.05, "k2")


@pytest.mark.parametrize("argv,start", [
    (["--no-rl-inference-logprobs-is-correction", "--use-tis", "--tis-upper-bound", "2"],
     "--no-rl-inference-logprobs-is-correction conflicts with --use-tis: "),
    (["--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef", "1.5", "--tis-upper-bound",
      "3"], "--rl-importance-sampling-truncation-coef 1.5 conflicts with --tis-upper-bound 3: "),
    (["--use-tis", "--rl-importance-sampling-truncation-coef", "1.5", "--tis-mode", "clip"],
     "--rl-importance-sampling-truncation-coef 1.5 conflicts with --tis-mode clip: "),
    (["--rl-importance-sampling-truncation-coef", "1.5"],
     "--rl-importance-sampling-truncation-coef 1.5 needs --rl-inference-logprobs-is-correction or --use-tis"),
    (["--rl-inference-logprobs-is-correction"], "--rl-inference-logprobs-is-correction without "),
    (["--tis-preset", "decoupled_seq_is", "--rl-importance-sampling-truncation-coef", "1.5"],
     "--rl-importance-sampling-truncation-coef 1.5 conflicts with --tis-preset decoupled_seq_is "
     "(--tis-upper-bound 2): "),
])
def test_the_correction_flags_are_refused_naming_what_was_typed(argv, start) -> None:
    message = refusal(argv)
    assert message.startswith(start), message


def test_the_correction_flags_map_onto_the_plugin() -> None:
    cfg = resolve(["--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef", "1.5"]).cfg
    assert (cfg.algorithm, cfg.mode, cfg.upper_bound) == (2, "truncate", 1.5)
    cfg = resolve(["--use-tis", "--rl-importance-sampling-truncation-coef", "1.5", "--tis-upper-bound", "1.5"]).cfg
    assert cfg.upper_bound == 1.5
    assert resolve(["--use-tis", "--use-rollout-log-probs", "--tis-upper-bound", "3"]).cfg.algorithm == 3


def test_a_namespace_without_the_record_counts_megatron_lms_numbers_as_typed() -> None:
    """Megatron-LM's values set on a namespace the launcher's parser did not parse (no ``tis_megatron_typed``):
    a disagreement is refused, agreement and Megatron-LM's values alone map; its switch counts as not typed."""
    parser = add_megatron_rl_tis_arguments(argparse.ArgumentParser())

    def ns(argv, **megatron_lm):
        args = parser.parse_args(argv)
        for k, v in dict(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.28, grpo_kl_beta=0.05,
                         grpo_entropy_term_weight=0.01, rl_inference_logprobs_is_correction=False,
                         rl_importance_sampling_truncation_coef=1.5, **megatron_lm).items():
            setattr(args, k, v)
        return args

    with pytest.raises(ValueError, match="^--grpo-clamp-eps-lower 0.2 conflicts with --eps-clip 0.3: "):
        resolve_megatron_rl_flags(ns(["--use-tis", "--eps-clip", "0.3"]))
    with pytest.raises(ValueError, match="^--grpo-kl-beta 0.05 conflicts with --tis-kl-coef 0: "):
        resolve_megatron_rl_flags(ns(["--use-tis", "--tis-kl-coef", "0"]))
    flags = resolve_megatron_rl_flags(ns(["--use-tis", "--use-rollout-log-probs", "--eps-clip", "0.2"]))
    cfg = flags.cfg
    assert (cfg.algorithm, cfg.upper_bound, cfg.eps_clip, cfg.eps_high, cfg.kl_coef, cfg.entropy_coef) == \
        (3, 1.5, 0.2, 0.28, 0.05, 0.01)
    assert flags.sampled_entropy



def test_sampling_support_replay_is_refused_naming_the_flag():
    """Megatron-LM's engine returns no support: an explicit replay is refused in one line, never ignored."""
    message = refusal(BASE + ["--tis-sampling-support", "replay"])
    assert message.startswith("--tis-sampling-support replay: Megatron-LM's inference engine returns no")
    assert resolve(BASE + ["--tis-sampling-support", "full"]).cfg.sampling_support == "full"


@pytest.mark.parametrize("extra, warns", [([], False), (["--rl-default-top-p", "0.9"], True),
                                          (["--rl-default-top-k", "20"], True), (["--rl-default-top-p", "1"], False)])
def test_truncated_sampling_warns_that_ratios_carry_the_kept_mass(extra, warns):
    parser = megatron_lm_parser()
    parser.add_argument("--rl-default-top-p", type=float, default=0)  # as d98e8a64dd's arguments.py
    parser.add_argument("--rl-default-top-k", type=int, default=-1)
    import warnings as w
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        resolve_megatron_rl_flags(parser.parse_args(BASE + extra))
    hits = [c for c in caught if "kept mass" in str(c.message)]
    assert len(hits) == (1 if warns else 0), [str(c.message) for c in caught]


def test_routing_replay_is_refused_with_its_reason():
    """Megatron-LM's RL loop carries no routed experts: the flag is refused in one line naming it, not ignored."""
    assert refusal(BASE + ["--tis-routing-replay"]).startswith("--tis-routing-replay: Megatron-LM's RL loop")
    assert not resolve(BASE).cfg.use_rollout_log_probs  # without it the launch resolves as before
