"""Command-line flags of slime_tis, as an argparse extension.

``add_tis_arguments(parser)`` takes and returns the parser, so it can be passed directly as
Megatron's ``extra_args_provider``. Options the host parser already defines (slime defines
``--use-tis``, ``--use-rollout-logprobs``, ``--eps-clip``, ``--eps-clip-high``, ``--eps-clip-c``)
are reused, never redefined, so argparse's conflict error cannot fire.

Every option defaults to ``None`` ("not given") so that ``--tis-preset NAME`` can be expanded first
and explicit flags override it; the help text states the effective default. Switches
(``--use-tis``, ``--use-rollout-log-probs``, ``--tis-batch-normalize``) can be turned on by a flag or
a preset, never off. Every flag, its help and its choices come from the declarations of the ``TISConfig``
fields (``slime_tis.config.ALL_OPTIONS``, see ``slime_tis.config_fields``).
"""

from __future__ import annotations

import argparse

from slime_tis.config import ALL_OPTIONS, config_fields_from_args
from slime_tis.config_fields import add_options

__all__ = ["add_tis_arguments", "config_fields_from_args"]


def add_tis_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the slime_tis flags to ``parser`` (reusing any it already defines) and return it."""
    return add_options(parser, ALL_OPTIONS, "slime_tis (rollout importance sampling)")
