"""The plugin's arguments in both of Megatron-LM's ``pretrain`` flows.

* megatron-core <= 0.17 (NVIDIA/Megatron-LM ``core_v0.17.1``, ``megatron/training/training.py`` ``pretrain``):
  ``pretrain(provider, model_provider, model_type, forward_step, extra_args_provider=..., args_defaults=...)``
  parses the command line itself (``initialize_megatron`` -> ``parse_args(extra_args_provider)``: Megatron-LM's
  parser, then the provider adds its flags) and then ``train()`` asks for the schedule.
* megatron-core >= 0.18 (``core_v0.18.2``, ``core_v0.19.0``, d98e8a64dd = 0.20.0): ``pretrain(cfg_container,
  provider, ...)`` has no ``extra_args_provider`` (the old call raises ``TypeError``); the launcher first calls
  ``megatron/training/arguments.py`` ``parse_and_validate_args(extra_args_provider=...)`` (parse, validate, set the
  global arguments), builds the container (``argument_utils.pretrain_cfg_container_from_args``) and passes it.
  The positional order after the provider changed between 0.18 (``model_provider, model_type, forward_step``) and
  0.19 (``model_type, forward_step, model_provider=None``), so the documented call names them.

The stand-ins below model only that argument path (written here, not copied); the real ``megatron.training``
(in the megatron-core wheels from 0.17 on, the Python 3.12 CI leg) is tested where it is installed.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types

import pytest
from megatron.core.pipeline_parallel import schedules

from slime_tis import TISConfig
from slime_tis.megatron import TISForwardBackward, add_megatron_tis_arguments, tis_patch
from slime_tis.megatron.arguments import megatron_hook_kwargs

ARGV = ["--use-tis", "--tis-mode", "clip", "--tis-upper-bound", "3", "--rl-default-temperature", "0.7"]


def _megatron_lm_parser() -> argparse.ArgumentParser:
    """The two Megatron-LM flags the plugin's arguments meet (``megatron/training/arguments.py``)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--rl-default-temperature", type=float, default=1.0)
    parser.add_argument("--bf16", action="store_true")
    return parser


class _MegatronLM:
    """``get_args`` plus the two ``pretrain`` signatures; ``train()`` asks ``launcher`` for the schedule."""

    def __init__(self, launcher, argv):
        self.args, self.launcher, self.argv, self.schedule = None, launcher, argv, None

    def get_args(self):
        return self.args

    def parse_and_validate_args(self, extra_args_provider=None, ignore_unknown_args=False, args_defaults=None):
        parser = _megatron_lm_parser()
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        self.args = parser.parse_args(self.argv)
        return self.args

    def _train(self):
        self.schedule = self.launcher.get_forward_backward_func(pp_size=1, vp_size=None)

    def pretrain_up_to_0_17(self, provider, model_provider, model_type, forward_step, process_non_loss_data_func=None,
                            extra_args_provider=None, args_defaults=None):
        self.parse_and_validate_args(extra_args_provider, args_defaults=args_defaults)
        self._train()

    def pretrain_from_0_19(self, cfg_container, provider, model_type, forward_step, model_provider=None,
                           process_non_loss_data_func=None):
        assert cfg_container is self.args
        self._train()


@pytest.fixture
def megatron_lm(monkeypatch):
    launcher = types.SimpleNamespace(get_forward_backward_func=schedules.get_forward_backward_func)
    lm = _MegatronLM(launcher, ARGV)
    training = types.ModuleType("megatron.training")
    training.get_args = lm.get_args
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    return lm


def _assert_hooked(fb, temperature):
    assert isinstance(fb, TISForwardBackward)
    assert fb.cfg == TISConfig(use_tis=True, mode="clip", upper=3.0) and fb.logprobs.temperature == temperature


def test_flow_up_to_0_17_pretrain_takes_the_provider(megatron_lm):
    with tis_patch(modules=[megatron_lm.launcher]):
        megatron_lm.pretrain_up_to_0_17(None, None, None, None, extra_args_provider=add_megatron_tis_arguments)
    _assert_hooked(megatron_lm.schedule, 0.7)  # --rl-default-temperature: the rollout's temperature


def test_flow_from_0_18_parses_first_then_pretrain_takes_the_container(megatron_lm):
    args = megatron_lm.parse_and_validate_args(extra_args_provider=add_megatron_tis_arguments)
    with pytest.raises(TypeError, match="extra_args_provider"):
        megatron_lm.pretrain_from_0_19(args, None, None, None, extra_args_provider=add_megatron_tis_arguments)
    with tis_patch(modules=[megatron_lm.launcher]):
        megatron_lm.pretrain_from_0_19(args, None, model_provider=None, model_type=None, forward_step=None)
    _assert_hooked(megatron_lm.schedule, 0.7)


def test_rollout_temperature_defaults_to_megatron_lms_sampling_temperature():
    """On Megatron-LM's parser ``--rollout-temperature`` defaults to ``--rl-default-temperature``; set, it wins;
    a parser without either gives 1.0, and a namespace without the attribute never raises."""
    def parse(*argv):
        return add_megatron_tis_arguments(_megatron_lm_parser()).parse_args(list(argv))

    assert megatron_hook_kwargs(parse("--rl-default-temperature", "0.7"))["temperature"] == 0.7
    assert megatron_hook_kwargs(parse("--rl-default-temperature", "0.7", "--rollout-temperature", "0.6"))[
        "temperature"] == 0.6
    assert megatron_hook_kwargs(parse())["temperature"] == 1.0
    assert megatron_hook_kwargs(add_megatron_tis_arguments(argparse.ArgumentParser()).parse_args([]))[
        "temperature"] == 1.0
    assert megatron_hook_kwargs(argparse.Namespace())["temperature"] == 1.0


def _real_training():
    try:
        import megatron.training.training as mt
        from megatron.training import pretrain
    except ImportError:
        pytest.skip("megatron.training ships with megatron-core >= 0.17 (the Python 3.12 leg)")
    return mt, pretrain


def test_real_pretrain_signature_matches_the_documented_flow():
    """The installed ``pretrain``: from 0.18 the documented keyword call binds and the old one raises
    ``TypeError``; up to 0.17 the old call binds."""
    _, pretrain = _real_training()
    sig = inspect.signature(pretrain)
    if "extra_args_provider" in sig.parameters:
        sig.bind(None, None, None, None, extra_args_provider=add_megatron_tis_arguments)
        return
    sig.bind(object(), None, model_provider=None, model_type=None, forward_step_func=None)
    with pytest.raises(TypeError, match="extra_args_provider"):
        sig.bind(None, None, None, None, extra_args_provider=add_megatron_tis_arguments)


def test_real_parse_and_validate_args_carries_the_plugins_flags(monkeypatch):
    """``parse_and_validate_args(extra_args_provider=add_megatron_tis_arguments)`` on Megatron-LM's own parser and
    validation; the hook reads the result through ``get_args`` under ``tis_patch`` (``modules=[mt]``)."""
    mt, pretrain = _real_training()
    if "extra_args_provider" in inspect.signature(pretrain).parameters:
        pytest.skip("megatron-core <= 0.17: pretrain parses the arguments itself")
    from megatron.training import get_args, global_vars
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["train.py", *ARGV, "--num-layers", "2", "--hidden-size", "32",
                                      "--num-attention-heads", "4", "--seq-length", "16",
                                      "--max-position-embeddings", "16", "--micro-batch-size", "1",
                                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"])
    global_vars.unset_global_variables()
    try:
        args = parse_and_validate_args(extra_args_provider=add_megatron_tis_arguments, args_defaults={})
        assert get_args() is args and args.rollout_temperature is None
        try:  # the documented container: with the GPT model config from 0.19, without it on 0.18
            from megatron.training.argument_utils import gpt_config_from_args
        except ImportError:
            pretrain_cfg_container_from_args(args)
        else:
            pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        with tis_patch(modules=[mt]):
            _assert_hooked(mt.get_forward_backward_func(pp_size=1, vp_size=None), 0.7)
    finally:
        global_vars.unset_global_variables()
