"""``python -m slime_tis.megatron_rl train_rl.py <args>``: run Megatron-LM's ``train_rl.py`` with the plugin in place.

Before the script runs, ``megatron.training.pretrain`` (and, on megatron-core >= 0.18,
``megatron.training[.arguments].parse_and_validate_args``) are wrapped so that the call ``train_rl.py``'s
``__main__`` makes gets

* ``extra_args_provider``: ``train_rl``'s own, then the plugin's flags (``add_megatron_rl_tis_arguments``);
* ``forward_step_func``: :meth:`RLHost.forward_step`, built from the parsed arguments on its first call
  (``megatron.training.get_args()``, ``get_num_microbatches()``), in place of ``train_rl.forward_step``.

The script then runs as ``__main__`` (``runpy.run_path``) with ``sys.argv`` = the script and its arguments.
Under ``torchrun`` the module is launched the same way: ``torchrun <torchrun args> -m slime_tis.megatron_rl
train_rl.py <args>``.
"""

from __future__ import annotations

import functools
import runpy
import sys

from slime_tis.megatron_rl.host import RLHost, add_megatron_rl_tis_arguments


def _with_tis_args(provider):
    def extra(parser):
        parser = provider(parser) if provider is not None else parser
        return add_megatron_rl_tis_arguments(parser)

    return extra


def megatron_rl_reader(args):
    """The iterator's element -> the item, as ``train_rl.forward_step`` reads it: a packed bin index through
    ``rl_utils.load_packed_data_by_index``; both layouts counted in ``get_rl_runtime_state()``'s sample count."""
    from megatron.rl.rl_utils import get_rl_runtime_state, load_packed_data_by_index

    def read(element):
        state = get_rl_runtime_state()
        if args.rl_use_sequence_packing:
            bin_index = int(element[0].item())  # host-sync-ok: the iterator's bin index, read before the forward
            item = load_packed_data_by_index(bin_index, state.packing_context,
                                             args.rl_inference_logprobs_is_correction)
            state.increment_sequences(len(item[9]))
        else:
            item = element
            state.increment_sequences(item[0].shape[0])
        return item

    return read


def lazy_forward_step():
    """A ``forward_step_func`` that builds the :class:`RLHost` from Megatron-LM's global args on first use."""
    host: list[RLHost] = []

    def forward_step(data_iterator, model, *args, **kwargs):
        if not host:
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            from megatron.training import get_args

            args = get_args()
            host.append(RLHost.from_args(args, get_num_microbatches, read_item=megatron_rl_reader(args)))
        return host[0].forward_step(data_iterator, model, *args, **kwargs)

    return forward_step


def install(training_module) -> None:
    """Wrap ``training_module.pretrain`` (and ``parse_and_validate_args`` where present) in place."""
    pretrain = training_module.pretrain

    @functools.wraps(pretrain)
    def pretrain_with_tis(*args, **kwargs):
        args = list(args)
        if "forward_step_func" in kwargs:
            kwargs["forward_step_func"] = lazy_forward_step()
        elif len(args) > 3 and callable(args[3]):
            args[3] = lazy_forward_step()
        else:
            raise ValueError("slime_tis.megatron_rl: pretrain(...) call without a forward_step_func to replace")
        if "extra_args_provider" in kwargs or not hasattr(training_module, "parse_and_validate_args"):
            kwargs["extra_args_provider"] = _with_tis_args(kwargs.get("extra_args_provider"))
        return pretrain(*args, **kwargs)

    training_module.pretrain = pretrain_with_tis
    for module in (training_module, getattr(training_module, "arguments", None)):
        parse = getattr(module, "parse_and_validate_args", None)
        if parse is not None:
            module.parse_and_validate_args = _parse_with_tis(parse)


def _parse_with_tis(parse):
    @functools.wraps(parse)
    def parse_with_tis(*args, **kwargs):
        kwargs["extra_args_provider"] = _with_tis_args(kwargs.get("extra_args_provider"))
        return parse(*args, **kwargs)

    return parse_with_tis


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit("usage: python -m slime_tis.megatron_rl train_rl.py <Megatron-LM and slime_tis flags>")
    import megatron.training as training
    import megatron.training.arguments  # noqa: F401  (train_rl.py imports parse_and_validate_args from it)

    install(training)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
