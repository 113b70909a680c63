"""Test-only import shim: lets ``verl`` 0.9.1 import without ``ray``, ``transformers`` and ``orjson``.

verl is installed with ``--no-deps``. Its rollout-correction helpers and its fused linear-cross-entropy
kernel are pure torch / Triton, but the package imports those three at module level (``verl.protocol``,
``verl.utils.torch_functional``, ``verl.utils.tracking``, ...), and only to define decorators, type hints
and classes that the helpers and the kernel never call. When one of them is missing, this module appends a
meta-path finder that answers every import of it with a permissive placeholder module:

* any attribute is another placeholder (so ``from ray.util import foo`` works);
* calling a placeholder returns its first argument when that is a lone callable (so it is a no-op
  decorator, ``@ray.remote``) and the placeholder itself otherwise;
* subclassing a placeholder subclasses ``object``; ``X | placeholder`` (a type hint) is the placeholder;
* a placeholder is false, so a feature probe through a stubbed package (``is_torch_npu_available()``) says no.

Import this module before the first ``import verl``. Installed packages are never shadowed: the
finder only covers roots that ``importlib.util.find_spec`` cannot find. Never import this outside
tests.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

__all__ = ["install", "STUBBED_ROOTS"]

_CANDIDATE_ROOTS = ("ray", "transformers", "orjson")


class _Placeholder(types.ModuleType):
    """A module whose every missing attribute is a child placeholder (registered in ``sys.modules``)."""

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _Placeholder(f"{self.__name__}.{name}")
        child.__path__ = []  # a package, so ``import parent.child.grandchild`` resolves
        sys.modules[child.__name__] = child
        setattr(self, name, child)
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # bare decorator use: @ray.remote
        return self

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __or__(self, other: Any) -> _Placeholder:  # type hints such as ``dict | TensorDict``
        return self

    __ror__ = __or__

    def __bool__(self) -> bool:  # a feature probe of a stubbed package answers "no" (``if is_npu_available():``)
        return False


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder + loader producing :class:`_Placeholder` modules for the given roots."""

    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] not in self.roots:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> frozenset[str]:
    """Install the finder for the missing roots (idempotent); return the roots it covers.

    With ``VERL_LIGHT_FORCE=1`` in the environment every root is stubbed even when installed
    (the finder then goes first on ``sys.meta_path``): for machines whose ``transformers`` is a
    version verl 0.9.1 cannot import, e.g. the GPU image used for ``benchmarks/bench_correction.py``.
    """
    for finder in sys.meta_path:
        if isinstance(finder, _PlaceholderFinder):
            return finder.roots
    if os.environ.get("VERL_LIGHT_FORCE") == "1":
        roots = frozenset(r for r in _CANDIDATE_ROOTS if r not in sys.modules)
        sys.meta_path.insert(0, _PlaceholderFinder(roots))
        return roots
    missing = frozenset(
        r for r in _CANDIDATE_ROOTS if r not in sys.modules and importlib.util.find_spec(r) is None
    )
    if missing:
        sys.meta_path.append(_PlaceholderFinder(missing))
    return missing


STUBBED_ROOTS = install()
