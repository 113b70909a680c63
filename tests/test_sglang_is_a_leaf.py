"""``slime_tis.sglang`` is the rollout side's public API and a leaf of the package: it imports only torch, the
standard library and itself, and no other module of the package imports it (the training step never depends on
it). Checked on the source (``ast``), so a new import in either direction fails here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "slime_tis"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_sglang_imports_only_torch_and_the_standard_library():
    for path in (PACKAGE / "sglang").glob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names or top in ("torch", "__future__"), f"{path.name} imports {name}"


def test_no_other_module_of_the_package_imports_sglang():
    for path in PACKAGE.rglob("*.py"):
        if "sglang" in path.relative_to(PACKAGE).parts:
            continue
        assert not any(n == "slime_tis.sglang" or n.startswith("slime_tis.sglang.") for n in _imports(path)), path
