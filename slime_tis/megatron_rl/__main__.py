"""``python -m slime_tis.megatron_rl train_rl.py <args>``: run Megatron-LM's ``train_rl.py`` with the plugin in place.

Before the script runs, ``megatron.training.pretrain`` and ``parse_and_validate_args`` (in
``megatron.training.arguments``, and in ``megatron.training`` where a version re-exports it) are wrapped so that
the calls ``train_rl.py``'s ``__main__`` makes get

* ``extra_args_provider``: ``train_rl``'s own, then the plugin's flags (``add_megatron_rl_tis_arguments``), in the
  call that parses the command line: ``parse_and_validate_args`` (Megatron-LM main: the script parses, then calls
  ``pretrain(cfg_container, ...)``, which takes no ``extra_args_provider``), or ``pretrain`` where its signature
  takes ``extra_args_provider`` (megatron-core <= 0.17);
* ``forward_step_func``: :meth:`RLHost.forward_step`, built from the parsed arguments on its first call
  (``megatron.training.get_args()``, ``get_num_microbatches()``), in place of ``train_rl.forward_step``;

and ``megatron.rl.rl_utils``' ``prepare_data_for_update`` / ``compute_logprobs_batch`` are wrapped
(``rollout.py``): the host's pi_old / pi_ref passes (skipped where the configuration needs none) and the rollout
collection handed to the host once. :func:`install_all` does both (a copy of ``train_rl.py`` calls it before its
own imports of ``pretrain``).

The script then runs as ``__main__`` (``runpy.run_path``) with ``sys.argv`` = the script and its arguments.
Under ``torchrun`` the module is launched the same way: ``torchrun <torchrun args> -m slime_tis.megatron_rl
train_rl.py <args>``.
"""

from __future__ import annotations

import functools
import inspect
import runpy
import sys
from collections.abc import Callable
from typing import Any

import torch

from slime_tis.megatron_rl.host import RLHost, add_megatron_rl_tis_arguments
from slime_tis.megatron_rl.rollout import RolloutHooks, install_rollout


def _with_tis_args(provider):
    def extra(parser):
        parser = provider(parser) if provider is not None else parser
        return add_megatron_rl_tis_arguments(parser)

    return extra


def megatron_rl_reader(args, rl_utils=None):
    """The iterator's element -> the item, as ``train_rl.forward_step`` reads it: a packed bin index through
    ``rl_utils.load_packed_data_by_index``, an unpacked element as it is."""
    if rl_utils is None:
        from megatron.rl import rl_utils

    def read(element):
        if not args.rl_use_sequence_packing:
            return element
        bin_index = int(element[0].item())  # host-sync-ok: the iterator's bin index, read before the forward
        return rl_utils.load_packed_data_by_index(bin_index, rl_utils.get_rl_runtime_state().packing_context,
                                                  args.rl_inference_logprobs_is_correction)

    return read


class Session:
    """The process's :class:`RLHost`, built from Megatron-LM's arguments on first use (the rollout's pi_old pass
    or the first training micro-batch, whichever comes first).

    Args:
        args: returns Megatron-LM's parsed arguments (``megatron.training.get_args``).
        num_microbatches: Megatron-LM's ``get_num_microbatches``.
        rl_utils: ``megatron.rl.rl_utils`` (the tests' stand-in).
    """

    def __init__(self, args: Callable[[], Any], num_microbatches: Callable[[], int], rl_utils: Any) -> None:
        self._args, self._m, self.rl_utils = args, num_microbatches, rl_utils
        self._host: RLHost | None = None

    def host(self) -> RLHost:
        if self._host is None:
            args = self._args()
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            state = self.rl_utils.get_rl_runtime_state
            self._host = RLHost.from_args(args, self._m, read_item=self.read_item(),
                                          on_sequences=lambda n: state().increment_sequences(n), device=device)
        return self._host

    def read_item(self) -> Callable[[Any], Any]:
        return megatron_rl_reader(self._args(), self.rl_utils)

    def forward_step(self, data_iterator, model, *args, **kwargs):
        return self.host().forward_step(data_iterator, model, *args, **kwargs)

    def install_rollout(self) -> RolloutHooks:
        """Wrap ``rl_utils``' update preparation (``rollout.py``): the host's pi_old / pi_ref and collection."""
        return install_rollout(self.rl_utils, self.host, lambda e: self.read_item()(e), self._args)


def lazy_forward_step(session: Session | None = None):
    """A ``forward_step_func`` that builds the :class:`RLHost` from Megatron-LM's global args on first use."""
    def forward_step(data_iterator, model, *args, **kwargs):
        return (session or _default_session()).forward_step(data_iterator, model, *args, **kwargs)

    return forward_step


_SESSION: list[Session] = []


def _default_session() -> Session:
    if not _SESSION:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.rl import rl_utils
        from megatron.training import get_args

        _SESSION.append(Session(get_args, get_num_microbatches, rl_utils))
    return _SESSION[0]


def install(training_module, session: Session | None = None) -> None:
    """Wrap ``training_module.pretrain`` (and ``parse_and_validate_args`` where present) in place.

    ``pretrain`` gets the plugin's flags (``extra_args_provider``) only where its signature takes that argument
    (megatron-core <= 0.17, where it parses the command line); from 0.18 on (``pretrain(cfg_container, ...)``)
    the script parses first, through ``parse_and_validate_args`` (``megatron.training.arguments``; re-exported by
    ``megatron.training`` in some versions), which is wrapped instead."""
    pretrain = training_module.pretrain
    parses = _takes(pretrain, "extra_args_provider")

    @functools.wraps(pretrain)
    def pretrain_with_tis(*args, **kwargs):
        args = list(args)
        if "forward_step_func" in kwargs:
            kwargs["forward_step_func"] = lazy_forward_step(session)
        elif len(args) > 3 and callable(args[3]):
            args[3] = lazy_forward_step(session)
        else:
            raise ValueError("slime_tis.megatron_rl: pretrain(...) call without a forward_step_func to replace")
        if parses:  # megatron-core <= 0.17: pretrain parses the command line itself
            kwargs["extra_args_provider"] = _with_tis_args(kwargs.get("extra_args_provider"))
        return pretrain(*args, **kwargs)

    training_module.pretrain = pretrain_with_tis
    for module in (training_module, getattr(training_module, "arguments", None)):
        parse = getattr(module, "parse_and_validate_args", None)
        if parse is not None:
            module.parse_and_validate_args = _parse_with_tis(parse)


def _takes(fn, name: str) -> bool:
    """Whether ``fn``'s signature has a parameter ``name`` (a ``**kwargs`` catch-all does not count)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a C function): take it as not taking ``name``
        return False


def _parse_with_tis(parse):
    @functools.wraps(parse)
    def parse_with_tis(*args, **kwargs):
        kwargs["extra_args_provider"] = _with_tis_args(kwargs.get("extra_args_provider"))
        return parse(*args, **kwargs)

    return parse_with_tis


def install_all() -> Session:
    """Everything the launcher installs, on Megatron-LM's modules; returns the process's :class:`Session`."""
    import megatron.training as training
    import megatron.training.arguments  # noqa: F401  (train_rl.py imports parse_and_validate_args from it)

    session = _default_session()
    install(training, session)
    session.install_rollout()
    return session


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit("usage: python -m slime_tis.megatron_rl train_rl.py <Megatron-LM and slime_tis flags>")
    install_all()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
