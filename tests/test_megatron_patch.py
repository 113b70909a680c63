"""``slime_tis.megatron.tis_patch`` against the real megatron-core modules, and the hook's
argument checks. End to end (a PP=2 step through the patched function vs the oracle) runs in tests/dist
(check ``pp2-a2_tok_trunc-M2-patch``)."""

from __future__ import annotations

import sys
import types

import megatron.core.pipeline_parallel as pp_pkg
import pytest
from megatron.core.pipeline_parallel import schedules

from slime_tis import TISConfig
from slime_tis.megatron import (
    TISForwardBackward,
    add_megatron_tis_arguments,
    default_get_tis_batch,
    tis_forward_backward_func,
    tis_patch,
)


def test_patch_hooks_every_binding_and_restores_them():
    original = schedules.get_forward_backward_func
    launcher = types.SimpleNamespace(get_forward_backward_func=original)  # "from ... import get_forward_backward_func"
    cfg = TISConfig(use_tis=True)
    with tis_patch(cfg, temperature=0.7, chunk_size=64, modules=[launcher]):
        for getter in (schedules.get_forward_backward_func, pp_pkg.get_forward_backward_func,
                       launcher.get_forward_backward_func):
            fb = getter(pp_size=1, vp_size=None)
            assert isinstance(fb, TISForwardBackward)
            assert fb.forward_backward_func is schedules.__dict__["forward_backward_no_pipelining"]
            assert fb.cfg is cfg and fb.logprobs.temperature == 0.7 and fb.logprobs.chunk_size == 64
        fb2 = launcher.get_forward_backward_func(pp_size=2, vp_size=None)
        assert fb2.forward_backward_func is schedules.forward_backward_pipelining_without_interleaving
    assert schedules.get_forward_backward_func is original
    assert pp_pkg.get_forward_backward_func is original
    assert launcher.get_forward_backward_func is original


def test_patch_restores_on_error_and_rejects_modules_without_the_function():
    original = schedules.get_forward_backward_func
    with pytest.raises(RuntimeError, match="boom"), tis_patch(TISConfig()):
        raise RuntimeError("boom")
    assert schedules.get_forward_backward_func is original
    with pytest.raises(ValueError, match="module 'x' has no get_forward_backward_func to patch"), \
            tis_patch(TISConfig(), modules=[types.ModuleType("x")]):
        pass
    assert schedules.get_forward_backward_func is original


def test_hook_arguments_are_checked():
    with pytest.raises(ValueError, match="cfg must be a slime_tis.TISConfig, got dict"):
        tis_forward_backward_func(schedules.forward_backward_no_pipelining, {"use_tis": True})
    with pytest.raises(ValueError, match="temperature must be a number > 0 .* got 0"):
        tis_forward_backward_func(schedules.forward_backward_no_pipelining, TISConfig(), temperature=0)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1, got -3"):
        tis_forward_backward_func(schedules.forward_backward_no_pipelining, TISConfig(), chunk_size=-3)


def test_micro_batch_items_must_carry_a_tis_batch():
    with pytest.raises(ValueError, match=r"item\['tis'\] = TISBatch\(...\) \(got dict with keys \['tokens'\]\)"):
        default_get_tis_batch({"tokens": None})
    with pytest.raises(ValueError, match=r"\(got tuple\)"):
        default_get_tis_batch((1, 2))


def test_forward_only_calls_pass_through_unchanged():
    calls = []

    def schedule(**kwargs):
        calls.append(kwargs)
        return ["ok"]

    fb = tis_forward_backward_func(schedule, TISConfig(use_tis=True))
    out = fb(forward_step_func=print, data_iterator=iter([1]), model=[], num_microbatches=1, forward_only=True,
             seq_length=4, micro_batch_size=1)
    assert out == ["ok"]
    assert calls == [dict(forward_step_func=print, data_iterator=calls[0]["data_iterator"], model=[],
                          num_microbatches=1, forward_only=True, seq_length=4, micro_batch_size=1)]


def test_megatron_lm_recipe_reads_the_parsed_arguments_when_the_schedule_is_requested(monkeypatch):
    """README recipe: ``with tis_patch(modules=[mt]): pretrain(..., extra_args_provider=add_megatron_tis_arguments)``.
    The patch is entered before Megatron-LM parses the command line; the config and the temperature are read
    from ``megatron.training.get_args()`` when ``train()`` asks for the schedule. Megatron-LM is not on PyPI:
    ``megatron.training`` is modelled by its one function used here (``get_args``, the parsed namespace)."""
    import argparse

    parsed = {}
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: parsed["args"]
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    launcher = types.SimpleNamespace(get_forward_backward_func=schedules.get_forward_backward_func)
    with tis_patch(modules=[launcher], chunk_size=32):
        parser = add_megatron_tis_arguments(argparse.ArgumentParser())  # what pretrain() does with the provider
        parsed["args"] = parser.parse_args(["--use-tis", "--tis-mode", "clip", "--rollout-temperature", "0.7"])
        fb = launcher.get_forward_backward_func(pp_size=1, vp_size=None)
    assert isinstance(fb, TISForwardBackward)
    assert fb.cfg == TISConfig(use_tis=True, mode="clip")
    assert fb.logprobs.temperature == 0.7 and fb.logprobs.chunk_size == 32
    args = add_megatron_tis_arguments(argparse.ArgumentParser()).parse_args([])
    assert args.rollout_temperature == 1.0
    host = argparse.ArgumentParser()
    host.add_argument("--rollout-temperature", type=float, default=0.5)  # slime defines it: reused, no conflict
    assert add_megatron_tis_arguments(host).parse_args([]).rollout_temperature == 0.5


def test_hook_options_are_checked():
    base = schedules.forward_backward_no_pipelining
    with pytest.raises(ValueError, match="pi_old must be one of \\('auto', 'rollout'\\), got 'step'"):
        tis_forward_backward_func(base, TISConfig(), pi_old="step")
    with pytest.raises(ValueError, match="grad_average must be a number > 0 .* got 0"):
        tis_forward_backward_func(base, TISConfig(), grad_average=0)


def test_micro_batch_index_counts_per_model_chunk_through_wrappers():
    """The hook's loss finds its micro-batch by counting forward_step calls per model chunk; the combined 1F1B
    schedule passes the unwrapped GPTModel where the other schedules pass the DDP wrapper: one count."""
    import torch

    from slime_tis.megatron.schedule import with_loss_funcs

    inner, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    wrapper = torch.nn.Module()
    wrapper.module = inner
    forward_step = with_loss_funcs(lambda it, m: (None, "own"),
                                   lambda k, m: (lambda out: k) if m is not other else None)
    got = [forward_step(None, m) for m in (wrapper, inner, other, wrapper, other)]
    assert [loss(None) for _, loss in (got[0], got[1], got[3])] == [0, 1, 2]  # one count through the wrapper
    assert got[2][1] == got[4][1] == "own"  # None: the launcher's own loss function


def test_output_layer_flags_parse_and_exclude_each_other(capsys):
    import argparse

    from slime_tis.megatron import megatron_hook_kwargs

    def parse(*argv):
        return add_megatron_tis_arguments(argparse.ArgumentParser()).parse_args(list(argv))

    assert megatron_hook_kwargs(parse()) == {"temperature": 1.0, "fused_output_layer": False, "fp32_lm_head": False,
                                             "routing_replay": False}
    assert megatron_hook_kwargs(parse("--tis-fused-output-layer", "--rollout-temperature", "0.6")) == {
        "temperature": 0.6, "fused_output_layer": True, "fp32_lm_head": False, "routing_replay": False}
    assert megatron_hook_kwargs(parse("--tis-routing-replay"))["routing_replay"] is True
    assert megatron_hook_kwargs(parse("--tis-fp32-lm-head"))["fp32_lm_head"] is True
    with pytest.raises(SystemExit):
        parse("--tis-fused-output-layer", "--tis-fp32-lm-head")
    err = capsys.readouterr().err
    assert "--tis-fp32-lm-head: not allowed with argument --tis-fused-output-layer" in err
    # a namespace built without the parser (slime sets attributes): the same error from the hook's side
    both = types.SimpleNamespace(tis_fused_output_layer=True, tis_fp32_lm_head=True)
    msg = "--tis-fused-output-layer and --tis-fp32-lm-head .* are mutually exclusive"
    with pytest.raises(ValueError, match=msg):
        megatron_hook_kwargs(both)
    with pytest.raises(ValueError, match=msg):
        tis_forward_backward_func(schedules.forward_backward_no_pipelining, TISConfig(), fused_output_layer=True,
                                  fp32_lm_head=True)
    with pytest.raises(ValueError, match="fp32_lm_head must be a bool, got 'yes'"):
        tis_forward_backward_func(schedules.forward_backward_no_pipelining, TISConfig(), fp32_lm_head="yes")
    # adding the flags twice (two providers) reuses them instead of an argparse conflict
    twice = add_megatron_tis_arguments(add_megatron_tis_arguments(argparse.ArgumentParser()))
    assert twice.parse_args(["--tis-fp32-lm-head"]).tis_fp32_lm_head is True


def test_hook_output_layer_mode_from_keywords_and_from_megatron_lm_args(monkeypatch):
    import argparse

    base = schedules.forward_backward_no_pipelining
    assert tis_forward_backward_func(base, TISConfig()).logprobs.output_layer is None
    assert tis_forward_backward_func(base, TISConfig(), fused_output_layer=True).logprobs.output_layer == "fused"
    assert tis_forward_backward_func(base, TISConfig(), fp32_lm_head=True).logprobs.output_layer == "fp32"
    parsed = {}
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: parsed["args"]
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    launcher = types.SimpleNamespace(get_forward_backward_func=schedules.get_forward_backward_func)
    parser = add_megatron_tis_arguments(argparse.ArgumentParser())
    with tis_patch(modules=[launcher]):
        parsed["args"] = parser.parse_args(["--tis-fused-output-layer"])
        assert launcher.get_forward_backward_func(pp_size=1, vp_size=None).logprobs.output_layer == "fused"
        parsed["args"] = parser.parse_args(["--tis-fp32-lm-head"])
        assert launcher.get_forward_backward_func(pp_size=1, vp_size=None).logprobs.output_layer == "fp32"
    with tis_patch(modules=[launcher], fp32_lm_head=False):  # a keyword wins over the parsed flag
        assert launcher.get_forward_backward_func(pp_size=1, vp_size=None).logprobs.output_layer is None
    with tis_patch(TISConfig(), fused_output_layer=True, modules=[launcher]):
        assert launcher.get_forward_backward_func(pp_size=1, vp_size=None).logprobs.output_layer == "fused"
    with tis_patch(TISConfig(), modules=[launcher]):
        assert launcher.get_forward_backward_func(pp_size=1, vp_size=None).logprobs.output_layer is None
