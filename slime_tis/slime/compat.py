"""slime options and slime code the hooks cannot follow, refused (or warned about) when the view is built.

The probes read the installed slime's source or signatures (without importing it); without slime they find
nothing. What is refused and why: docs/slime.md, "slime's open changes to the loss path".
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import logging
import sys
from pathlib import Path
from typing import Any

from slime_tis.core.algorithms import algorithm_of

__all__ = ["check_slime_compat", "slime_function_params", "slime_source"]

logger = logging.getLogger("slime_tis.slime")

PATCH_MARKER = "skips_pi_old_recompute"  # what patches/slime_alg1_skip_recompute.patch adds to slime's actor.py


@functools.cache
def slime_source(module: str) -> str | None:
    """The source text of slime's ``module`` (``None`` when slime, or the module, is not installed)."""
    try:
        loaded = sys.modules.get(module)
        if loaded is not None:
            return inspect.getsource(loaded)
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        return Path(spec.origin).read_text(encoding="utf-8")
    except (ImportError, ValueError, OSError, TypeError):
        return None


@functools.cache
def slime_function_params(module: str, name: str) -> tuple[str, ...] | None:
    """The parameter names of slime's top-level function ``module.name`` (``None`` when not found)."""
    fn = getattr(sys.modules.get(module), name, None)
    if fn is not None:
        try:
            return tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            pass
    source = slime_source(module)
    if source is None:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            a = node.args
            return tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))
    return None


def check_slime_compat(view: Any) -> None:
    """Refuse what the hooks cannot follow (module docstring); ``view``: :class:`slime_tis.slime.config.SlimeView`."""
    from slime_tis.slime.state import STATE

    if view.rs_batch_refill:
        raise ValueError("--rs-batch-refill: slime then applies its own sequence rejection in place of "
                         "--custom-tis-function-path and refuses the plugin's rollout-data and before-train-step "
                         "hooks; run it without the plugin's hooks, or the hooks without --rs-batch-refill")
    if view.cfg.sampling_support is not None:
        raise ValueError(f"tis_sampling_support = {view.cfg.sampling_support!r}: slime computes the trainer's "
                         "log-probs itself and replays its own top-p support (--rollout-top-p < 1), so the plugin's "
                         "replay does not apply to slime; remove the key (docs/sampling_support.md)")
    top_k, top_p = view.rollout_top_k, view.rollout_top_p
    if isinstance(top_k, int) and top_k > 0 and top_p == 1.0:
        STATE.warn_once("top_k", f"--rollout-top-k {top_k} with --rollout-top-p 1: slime replays the truncated "
                        "support only when --rollout-top-p < 1, so SGLang's rollout log-probs are of the full "
                        "distribution and every importance ratio is biased by the kept mass; use --rollout-top-k -1, "
                        "or also set --rollout-top-p < 1", logger)
    if view.skips_recompute:
        actor = slime_source("slime.backends.megatron_utils.actor")
        if actor is not None and PATCH_MARKER not in actor:
            raise ValueError("tis_bypass_skip_recompute is on, but the installed slime's "
                             "slime/backends/megatron_utils/actor.py lacks patches/slime_alg1_skip_recompute.patch "
                             "(slime still runs its pi_old pass): apply the patch or remove the key")
    if algorithm_of(view.cfg).ppo and view.use_opsm:  # slime's own policy loss with the TIS hook
        params = slime_function_params("slime.utils.ppo_utils", "compute_opsm_mask")
        if params is not None and "full_advantages" in params:
            raise ValueError("--use-opsm: the installed slime decides OPSM per sequence (compute_opsm_mask takes "
                             "full_advantages) and zeroes tokens of either advantage sign, which the TIS hook, "
                             "recovering OPSM's tokens from A < 0, would count as kept; remove --use-opsm "
                             "(tis_rs_level or a k3 rejection threshold rejects off-policy sequences)")
