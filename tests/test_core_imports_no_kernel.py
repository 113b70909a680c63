"""The correction core imports only torch, the standard library and itself: no kernel (``slime_tis.kernels``), no
host, no engine. The kernel choice (``--tis-kernels``) stays with the configuration and the hosts, which hand the core
an implementation of its token pass (``Plan.token_pass``). Checked on the source (``ast``, imports inside functions
included), so a new import fails here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "slime_tis" / "core"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            # relative: ".x" stays inside the core, "..x" leaves it
            names.add("." * node.level + (node.module or ""))
    return names


def test_core_imports_nothing_from_the_kernels():
    found = {p.name: sorted(n for n in _imports(p) if n == "slime_tis.kernels" or n.startswith("slime_tis.kernels."))
             for p in CORE.glob("*.py")}
    assert not {k: v for k, v in found.items() if v}, found


def test_core_imports_only_torch_the_standard_library_and_itself():
    assert len(list(CORE.glob("*.py"))) > 10  # the directory is found
    for path in CORE.glob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            own = (name == "slime_tis.core" or name.startswith("slime_tis.core.")
                   or (name.startswith(".") and not name.startswith("..")))
            assert own or top in sys.stdlib_module_names or top in ("torch", "__future__"), f"{path.name}: {name}"
