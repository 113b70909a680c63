"""Patch an existing megatron training script so that its schedule uses the rollout correction.

For launchers that call ``get_forward_backward_func()`` themselves. Megatron-LM (``pretrain`` -> ``train``,
which obtains the schedule once and hands it to every ``train_step``), megatron-core >= 0.18 (``pretrain`` takes
the config container first and no ``extra_args_provider``)::

    import megatron.training.training as mt
    from megatron.training import pretrain
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from slime_tis.megatron import add_megatron_tis_arguments, tis_patch

    args = parse_and_validate_args(extra_args_provider=add_megatron_tis_arguments)
    with tis_patch(modules=[mt]):          # cfg and temperature from Megatron-LM's parsed args
        pretrain(pretrain_cfg_container_from_args(args, model_cfg), train_valid_test_datasets_provider,
                 model_provider=model_provider, model_type=model_type, forward_step_func=forward_step)

(``model_cfg``: ``gpt_config_from_args(args)`` from 0.19, as Megatron-LM's ``pretrain_gpt.py`` does; 0.18 takes
``pretrain_cfg_container_from_args(args)``). megatron-core <= 0.17: ``with tis_patch(modules=[mt]):
pretrain(train_valid_test_datasets_provider, model_provider, model_type, forward_step,
extra_args_provider=add_megatron_tis_arguments)``.

Inside the ``with`` block ``get_forward_backward_func`` returns ``tis_forward_backward_func(<megatron's>,
cfg, ...)`` in ``megatron.core.pipeline_parallel``, ``megatron.core.pipeline_parallel.schedules`` and
every module in ``modules`` that imported the name (``from ... import get_forward_backward_func`` binds a
copy, so those modules must be listed). Everything is restored on exit.

``cfg=None`` (default) builds ``TISConfig.from_args(megatron.training.get_args())`` when the schedule is
first requested, i.e. after the command line was parsed (``add_megatron_tis_arguments`` adds the flags), and
``temperature=None`` then reads ``--rollout-temperature`` (else ``--rl-default-temperature``, else 1.0),
``fused_output_layer=None`` / ``fp32_lm_head=None`` / ``routing_replay=None`` read ``--tis-fused-output-layer`` /
``--tis-fp32-lm-head`` / ``--tis-routing-replay`` (``megatron_hook_kwargs``). With an explicit ``cfg``, ``None``
means 1.0 / False / False / False.
The micro-batch items must carry ``item["tis"] = TISBatch(...)`` or ``get_tis_batch=`` must build it
(docs/megatron.md, "Data contract"); other keywords go to ``tis_forward_backward_func``.
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
    """The config and the hook keywords (``temperature``, ``fused_output_layer``, ``fp32_lm_head``,
    ``routing_replay``): the given ones, the others from Megatron-LM's parsed args (``cfg=None``) or the
    defaults."""
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
