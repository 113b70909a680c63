"""GPU kernels (Triton, tested on CPU with ``TRITON_INTERPRET=1``); import the submodules directly.

Importing this package imports nothing else (no triton): each submodule imports triton lazily.
"""
