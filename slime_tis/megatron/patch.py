"""``tis_patch``: inside the block, ``get_forward_backward_func()`` returns the hooked schedule, in megatron-core's
``pipeline_parallel`` (and ``.schedules``) and in every module of ``modules`` (``from ... import`` binds a copy);
restored on exit. ``cfg=None`` reads the configuration and the hook keywords from Megatron-LM's parsed arguments
when the schedule is first requested; with a ``cfg`` a ``None`` keyword means its default. Recipes for every
megatron-core version: docs/megatron.md, "Megatron-LM's training loop".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from slime_tis.config import TISConfig
from slime_tis.engine.settings import CHUNK_SIZE
from slime_tis.megatron.arguments import megatron_hook_kwargs
from slime_tis.megatron.hook import tis_forward_backward_func

__all__ = ["tis_patch"]

_ATTR = "get_forward_backward_func"


def _from_megatron_lm_args(cfg: TISConfig | None, given: dict[str, Any]) -> tuple[TISConfig, dict[str, Any]]:
    """The config and the hook keywords: the given ones, the others from Megatron-LM's parsed args (``cfg=None``)
    or the defaults."""
    if cfg is not None:
        defaults = {"temperature": 1.0, "fused_output_layer": False, "fp32_lm_head": False, "routing_replay": False}
        return cfg, {k: defaults[k] if v is None else v for k, v in given.items()}
    try:
        from megatron.training import get_args
    except ImportError as err:
        raise ValueError("tis_patch(cfg=None) reads Megatron-LM's arguments (megatron.training.get_args), which "
                         "is not importable here; pass cfg=TISConfig(...) and temperature=...") from err
    args = get_args()
    from_args = megatron_hook_kwargs(args)
    return TISConfig.from_args(args), {k: from_args[k] if v is None else v for k, v in given.items()}


@contextlib.contextmanager
def tis_patch(cfg: TISConfig | None = None, *, temperature: float | None = None,
              fused_output_layer: bool | None = None, fp32_lm_head: bool | None = None,
              routing_replay: bool | None = None, chunk_size: int = CHUNK_SIZE, modules: Sequence[Any] = (),
              **hook_kwargs: Any) -> Iterator[None]:
    """Make ``get_forward_backward_func()`` return the hooked schedule while the block runs."""
    import megatron.core.pipeline_parallel as pp_pkg
    from megatron.core.pipeline_parallel import schedules

    if cfg is not None and not isinstance(cfg, TISConfig):
        raise ValueError(f"tis_patch: cfg must be a slime_tis.TISConfig or None, got {type(cfg).__name__}")
    original = schedules.get_forward_backward_func

    def hooked_get_forward_backward_func(*args: Any, **kwargs: Any):
        the_cfg, resolved = _from_megatron_lm_args(cfg, {"temperature": temperature,
                                                         "fused_output_layer": fused_output_layer,
                                                         "fp32_lm_head": fp32_lm_head,
                                                         "routing_replay": routing_replay})
        return tis_forward_backward_func(original(*args, **kwargs), the_cfg, chunk_size=chunk_size, **resolved,
                                         **hook_kwargs)

    targets = [schedules, pp_pkg, *modules]
    for mod in targets:  # validate everything before changing anything
        if not hasattr(mod, _ATTR):
            raise ValueError(f"tis_patch: module {getattr(mod, '__name__', mod)!r} has no {_ATTR} to patch")
    saved = [(mod, getattr(mod, _ATTR)) for mod in targets]
    for mod in targets:
        setattr(mod, _ATTR, hooked_get_forward_backward_func)
    try:
        yield
    finally:
        for mod, value in reversed(saved):
            setattr(mod, _ATTR, value)
