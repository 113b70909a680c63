"""``add_tis_arguments(parser)``: the slime_tis flags (from the ``TISConfig`` declarations), usable as Megatron's
``extra_args_provider``. Flags the host parser already defines are reused; every option defaults to ``None`` (not
given), so that ``--tis-preset`` expands first and explicit flags override it; switches only turn on.
"""

from __future__ import annotations

import argparse

from slime_tis.config import ALL_OPTIONS, config_fields_from_args
from slime_tis.config_fields import add_options

__all__ = ["add_tis_arguments", "config_fields_from_args"]


def add_tis_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the slime_tis flags to ``parser`` (reusing any it already defines) and return it."""
    return add_options(parser, ALL_OPTIONS, "slime_tis (rollout importance sampling)")
