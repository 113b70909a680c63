"""Test-only: megatron-core 0.19.x imports a triton kernel module unconditionally; 0.16.1 does not.

When triton is absent, register a placeholder for that one megatron module (never a fake ``triton``:
torch._inductor would then believe triton exists and crash).
"""

import sys
import types

try:
    import triton  # noqa: F401
except ImportError:
    _name = "megatron.core.transformer.moe.ops.paged_stash"
    if _name not in sys.modules:
        _m = types.ModuleType(_name)
        _m.GLOBAL_BLOCK_SIZE = 1024

        def _unavailable(*args, **kwargs):
            raise RuntimeError("paged_stash triton kernel is unavailable on CPU")

        class _Kernel:
            """Supports ``kernel[grid](...)`` and ``kernel(...)``; both raise."""

            def __getitem__(self, grid):
                return _unavailable

            __call__ = staticmethod(_unavailable)

        _m.paged_stash_copy_kernel = _Kernel()
        _m.paged_stash_pop_kernel = _Kernel()
        _m.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
        sys.modules[_name] = _m
