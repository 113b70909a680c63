"""Top-level shim for launchers run from the repository root: ``from arguments import add_tis_arguments``.

The implementation lives in :mod:`slime_tis.arguments` (installed with the package).
"""

from slime_tis.arguments import add_tis_arguments, config_fields_from_args

__all__ = ["add_tis_arguments", "config_fields_from_args"]
