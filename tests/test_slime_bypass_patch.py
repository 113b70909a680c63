"""The optional slime patch reads ``tis_bypass_skip_recompute`` as the plugin reads every switch.

The statement the patch adds to slime's ``train_actor`` runs here as written in the patch file, followed by
slime 624b824's condition for its pi_old pass (``(not use_rollout_logprobs or get_mismatch_metrics) and not
can_reuse_log_probs_in_loss``, ``slime/backends/megatron_utils/actor.py``); ``can_reuse_log_probs_in_loss`` is
False, as ``--get-mismatch-metrics`` makes it in slime.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from _slime_sim import slime_args

from slime_tis.slime import tis_config_from_slime_args
from slime_tis.slime.bypass import SKIP_RECOMPUTE_KEY
from slime_tis.slime.config import slime_view

PATCH = Path(__file__).resolve().parents[1] / "patches" / "slime_alg1_skip_recompute.patch"


def _added_statement() -> str:
    lines = [ln[1:] for ln in PATCH.read_text().splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return textwrap.dedent("\n".join(lines))


def _patched_slime_runs_pi_old_pass(**kw) -> bool:
    args = SimpleNamespace(**{"use_rollout_logprobs": False, "get_mismatch_metrics": False, **kw})
    scope = {"self": SimpleNamespace(args=args), "can_reuse_log_probs_in_loss": False}
    exec(compile(_added_statement(), str(PATCH), "exec"), scope)
    return bool((not args.use_rollout_logprobs or args.get_mismatch_metrics)
                and not scope["can_reuse_log_probs_in_loss"])


ON = [True, "true", "True", "yes", "on", "1", 1]
OFF = [False, "false", "False", "no", "off", "0", 0, None]


@pytest.mark.parametrize(("value", "skips"), [(v, True) for v in ON] + [(v, False) for v in OFF])
def test_the_patch_and_the_plugin_read_the_key_as_a_switch(value, skips):
    """A quoted ``"false"`` / ``"no"`` keeps slime's pi_old pass; the plugin agrees on whether slime ran it."""
    kw = dict(use_rollout_logprobs=True, get_mismatch_metrics=True)
    if value is not None:
        kw[SKIP_RECOMPUTE_KEY] = value
    assert _patched_slime_runs_pi_old_pass(**kw) is (not skips)
    assert slime_view(slime_args(**kw)).skips_recompute is skips


def test_the_key_acts_only_with_rollout_logprobs():
    kw = {"get_mismatch_metrics": True, SKIP_RECOMPUTE_KEY: True}
    assert _patched_slime_runs_pi_old_pass(**kw)
    assert not slime_view(slime_args(**kw)).skips_recompute


@pytest.mark.parametrize("value", ["ture", "disabled", 2, [], {}])
def test_a_value_the_switch_cannot_read_stops_the_run_naming_the_key(value):
    """In the patched slime and at the plugin's first hook call (which builds its configuration)."""
    kw = {"use_rollout_logprobs": True, "get_mismatch_metrics": True, SKIP_RECOMPUTE_KEY: value}
    with pytest.raises(ValueError, match=SKIP_RECOMPUTE_KEY):
        _patched_slime_runs_pi_old_pass(**kw)
    with pytest.raises(ValueError, match=SKIP_RECOMPUTE_KEY):
        tis_config_from_slime_args(slime_args(**kw))
