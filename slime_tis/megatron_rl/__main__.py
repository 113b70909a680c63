"""``python -m slime_tis.megatron_rl train_rl.py <args>`` (under ``torchrun`` alike): Megatron-LM's ``train_rl.py``
with the plugin in place (docs/megatron_rl.md, "Launch"). :func:`install_all` wraps ``pretrain`` and
``parse_and_validate_args`` (the plugin's flags go to whichever parses the command line; :meth:`RLHost.forward_step`
replaces ``train_rl.forward_step``) and ``rl_utils``' update preparation (``rollout.py``); the script then runs as
``__main__``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import runpy
import sys
from collections.abc import Callable
from typing import Any

import torch

from slime_tis.megatron_rl.host import RLHost, add_megatron_rl_tis_arguments
from slime_tis.megatron_rl.rollout import install_rollout


def _with_tis_args(call: Callable) -> Callable:
    """``call`` whose ``extra_args_provider`` adds the plugin's flags after the caller's own."""

    @functools.wraps(call)
    def with_tis_args(*args, **kwargs):
        provider = kwargs.get("extra_args_provider")
        kwargs["extra_args_provider"] = lambda parser: add_megatron_rl_tis_arguments(
            provider(parser) if provider is not None else parser)
        return call(*args, **kwargs)

    return with_tis_args


def megatron_rl_reader(args, rl_utils):
    """The iterator's element -> the item, as ``train_rl.forward_step`` reads it: a packed bin index through
    ``rl_utils.load_packed_data_by_index``, an unpacked element as it is."""
    def read(element):
        if not args.rl_use_sequence_packing:
            return element
        bin_index = int(element[0].item())  # host-sync-ok: the iterator's bin index, read before the forward
        return rl_utils.load_packed_data_by_index(bin_index, rl_utils.get_rl_runtime_state().packing_context,
                                                  args.rl_inference_logprobs_is_correction)

    return read


class Session:
    """The process's :class:`RLHost`, built on first use from ``args()`` (Megatron-LM's ``get_args``),
    ``num_microbatches`` (``get_num_microbatches``) and ``rl_utils`` (``megatron.rl.rl_utils`` or a stand-in)."""

    def __init__(self, args: Callable[[], Any], num_microbatches: Callable[[], int], rl_utils: Any) -> None:
        self.args, self._m, self.rl_utils = args, num_microbatches, rl_utils
        self._host: RLHost | None = None

    def host(self) -> RLHost:
        if self._host is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            state = self.rl_utils.get_rl_runtime_state
            self._host = RLHost.from_args(self.args(), self._m, read_item=self.read_item(),
                                          on_sequences=lambda n: state().increment_sequences(n), device=device)
        return self._host

    def read_item(self) -> Callable[[Any], Any]:
        return megatron_rl_reader(self.args(), self.rl_utils)


@functools.cache
def _default_session() -> Session:
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.rl import rl_utils
    from megatron.training import get_args

    return Session(get_args, get_num_microbatches, rl_utils)


def lazy_forward_step(session: Session | None = None):
    """A ``forward_step_func`` that builds the :class:`RLHost` from Megatron-LM's global args on first use."""
    def forward_step(data_iterator, model, *args, **kwargs):
        return (session or _default_session()).host().forward_step(data_iterator, model, *args, **kwargs)

    return forward_step


def install(training_module, session: Session | None = None) -> None:
    """Wrap ``training_module.pretrain`` (its ``forward_step_func``; its ``extra_args_provider`` where its signature
    takes one, megatron-core <= 0.17) and ``parse_and_validate_args`` (there and in its ``arguments`` module) in
    place."""
    original = pretrain = training_module.pretrain
    with contextlib.suppress(TypeError, ValueError):  # no signature to read (a C function)
        if "extra_args_provider" in inspect.signature(pretrain).parameters:
            pretrain = _with_tis_args(pretrain)

    @functools.wraps(original)
    def pretrain_with_tis(*args, **kwargs):
        args = list(args)
        if "forward_step_func" in kwargs:
            kwargs["forward_step_func"] = lazy_forward_step(session)
        elif len(args) > 3 and callable(args[3]):
            args[3] = lazy_forward_step(session)
        else:
            raise ValueError("slime_tis.megatron_rl: pretrain(...) call without a forward_step_func to replace")
        return pretrain(*args, **kwargs)

    training_module.pretrain = pretrain_with_tis
    for module in (training_module, getattr(training_module, "arguments", None)):
        parse = getattr(module, "parse_and_validate_args", None)
        if parse is not None:
            module.parse_and_validate_args = _with_tis_args(parse)


def install_all() -> Session:
    """Everything the launcher installs, on Megatron-LM's modules; returns the process's :class:`Session`."""
    import megatron.training as training
    import megatron.training.arguments  # noqa: F401  (train_rl.py imports parse_and_validate_args from it)

    session = _default_session()
    install(training, session)
    install_rollout(session.rl_utils, session.host, lambda e: session.read_item()(e), session.args)
    return session


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit("usage: python -m slime_tis.megatron_rl train_rl.py <Megatron-LM and slime_tis flags>")
    install_all()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
