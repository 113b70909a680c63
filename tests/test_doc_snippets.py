"""Every fenced ``python`` and ``bash`` block of README.md and docs/*.md is checked as written.

* A python block runs as shown, in a fresh interpreter started from an empty directory (so its imports resolve
  from the installed package, not from the repository root), unless the line right before its fence is a
  fragment marker, ``<!-- fragment: why -->`` (a piece of a launcher, an API listing): a fragment is shown, not
  run. The Megatron fragments of README.md and docs/megatron.md are still checked: every import they make
  resolves, and every other name they use is one the launcher itself provides (its parser, model, forward_step,
  micro-batch counts ...), never a plugin name the snippet forgot to import.
* A bash block (they install packages or train, so none is run) parses with ``bash -n``; a block that is only
  command-line additions (its first command starts with ``-``) must carry the fragment marker.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(python|bash)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
FRAGMENT = "<!-- fragment"

# Names a user's launcher has before it adds the plugin (documented around each snippet).
LAUNCHER_NAMES = {
    "parser", "forward_step", "it", "model", "M", "S", "B", "N", "K", "rollout_it", "optimizer",
    "train_valid_test_datasets_provider", "model_provider", "get_tis_batch", "args", "forward_backward",
}


def _blocks() -> list[tuple[str, int, str, str, bool]]:
    """``(file, line of the fence, language, code, is_fragment)`` of every python / bash block."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            out.append((str(path.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2),
                        before.startswith(FRAGMENT)))
    return out


BLOCKS = _blocks()
RUN = [(f, n, code) for f, n, lang, code, frag in BLOCKS if lang == "python" and not frag]
BASH = [(f, n, code, frag) for f, n, lang, code, frag in BLOCKS if lang == "bash"]


def test_the_blocks_are_found():
    """The extraction sees the README's examples and the docs' blocks (a changed fence style would hide them)."""
    files = {f for f, *_ in BLOCKS}
    assert {"README.md", "docs/slime.md", "docs/megatron.md", "docs/example.md"} <= files
    assert len(RUN) >= 2 and len(BASH) >= 20


@pytest.mark.parametrize("where,line,code", RUN, ids=[f"{f}:{n}" for f, n, _ in RUN])
def test_python_block_runs_as_shown(where, line, code, tmp_path):
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{where}:{line} (mark it <!-- fragment: why --> if it is one)\n{proc.stderr[-2000:]}"


@pytest.mark.parametrize("where,line,code,fragment", BASH, ids=[f"{f}:{n}" for f, n, _, _ in BASH])
def test_bash_block_parses(where, line, code, fragment):
    proc = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{where}:{line}: {proc.stderr}"
    first = next((s.strip() for s in code.splitlines() if s.strip() and not s.strip().startswith("#")), "")
    assert fragment or not first.startswith("-"), f"{where}:{line} is command-line additions: mark it a fragment"


SNIPPETS = [(f, n, code) for f, n, lang, code, frag in BLOCKS
            if lang == "python" and frag and f in ("README.md", "docs/megatron.md")
            and re.search(r"^(from|import) ", code, flags=re.M)]


def _free_names(tree: ast.AST) -> set[str]:
    """Names loaded but never bound (assigned, imported, def'd, loop/with/comprehension targets) in the snippet."""
    bound, loaded = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
            if isinstance(node, ast.FunctionDef):
                bound.update(a.arg for a in node.args.args)
    return loaded - bound


@pytest.mark.parametrize("where,index,code", SNIPPETS, ids=[f"{w}:{i}" for w, i, _ in SNIPPETS])
def test_snippet_uses_only_imported_or_launcher_names(where, index, code):
    missing = _free_names(ast.parse(code)) - LAUNCHER_NAMES
    assert not missing, f"{where} snippet {index} uses {sorted(missing)} without importing them"


def _imports(code: str) -> list[str]:
    return [ast.unparse(n) for n in ast.parse(code).body if isinstance(n, (ast.Import, ast.ImportFrom))]


# each snippet's import lines, run in a fresh namespace; the outcome per snippet (None or the traceback's tail)
_IMPORT_RUNNER = """import json, sys, traceback
res = {}
for key, src in json.load(sys.stdin).items():
    try:
        exec(compile(src, key, "exec"), {"__name__": "__snippet__"})
        res[key] = None
    except BaseException:
        res[key] = traceback.format_exc()[-2000:]
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def import_outcomes(tmp_path_factory) -> dict:
    """Every snippet's imports in one fresh interpreter (torch and megatron are imported once), started from an
    empty directory so that nothing resolves through the repository root (patches/, examples/)."""
    blocks = {f"{w}#{i}": "\n".join(_imports(code)) for w, i, code in SNIPPETS}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_RUNNER], input=json.dumps(blocks),
                          cwd=tmp_path_factory.mktemp("snippets"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("where,index,code", SNIPPETS, ids=[f"{w}:{i}" for w, i, _ in SNIPPETS])
def test_snippet_imports_resolve_outside_the_repository(where, index, code, import_outcomes):
    imports = _imports(code)
    assert imports, f"{where} snippet {index} imports nothing"
    if any("megatron.training" in line for line in imports):
        pytest.importorskip("megatron.training", reason="megatron-core < 0.17 ships no megatron.training")
    error = import_outcomes[f"{where}#{index}"]
    assert error is None, f"{where} snippet {index}: {error}"
