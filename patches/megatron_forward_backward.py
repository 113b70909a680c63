"""Patch an existing megatron-core training script so that its schedule uses the rollout correction.

For launchers that call ``get_forward_backward_func()`` themselves (Megatron-LM's ``train_step``, most
RL launchers), instead of editing the call site::

    from patches.megatron_forward_backward import tis_patch
    import megatron.training.training as mt                    # the module(s) that call it

    with tis_patch(TISConfig.from_args(args), temperature=args.rollout_temperature, modules=[mt]):
        pretrain(...)                                          # unchanged

Inside the ``with`` block ``get_forward_backward_func`` returns ``tis_forward_backward_func(<megatron's>,
cfg, ...)`` in ``megatron.core.pipeline_parallel``, ``megatron.core.pipeline_parallel.schedules`` and
every module in ``modules`` that imported the name (``from ... import get_forward_backward_func`` binds a
copy, so those modules must be listed). Everything is restored on exit. The micro-batch items must carry
``item["tis"] = TISBatch(...)`` (docs/megatron.md, "Data contract"); the flags come from
``slime_tis.arguments.add_tis_arguments`` (pass it as megatron's ``extra_args_provider``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from slime_tis.config import TISConfig
from slime_tis.megatron import tis_forward_backward_func

__all__ = ["tis_patch"]

_ATTR = "get_forward_backward_func"


@contextlib.contextmanager
def tis_patch(cfg: TISConfig, *, temperature: float = 1.0, chunk_size: int = 1024,
              modules: Sequence[Any] = (), **hook_kwargs: Any) -> Iterator[None]:
    """Make ``get_forward_backward_func()`` return the hooked schedule while the block runs."""
    import megatron.core.pipeline_parallel as pp_pkg
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func

    def hooked_get_forward_backward_func(*args: Any, **kwargs: Any):
        return tis_forward_backward_func(original(*args, **kwargs), cfg, temperature=temperature,
                                         chunk_size=chunk_size, **hook_kwargs)

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
