"""The Megatron snippets of the README and docs run as written: every import they make resolves from the installed
package (not from the repository root), and every other name they use is one the launcher itself provides
(its parser, model, forward_step, micro-batch counts ...), never a plugin name the snippet forgot to import."""

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

# Names a user's launcher has before it adds the plugin (documented around each snippet).
LAUNCHER_NAMES = {
    "parser", "forward_step", "it", "model", "M", "S", "B", "N", "K", "rollout_it", "optimizer",
    "train_valid_test_datasets_provider", "model_provider", "get_tis_batch", "args", "forward_backward",
}


def _python_blocks(path: Path, heading: str | None) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if heading is not None:
        start = text.index(heading)
        end = text.find("\n## ", start + len(heading))
        text = text[start:end if end > 0 else None]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


SNIPPETS = [
    *(("README.md", i, b) for i, b in enumerate(_python_blocks(ROOT / "README.md", "## Using with Megatron"))),
    *(("docs/megatron.md", i, b) for i, b in enumerate(_python_blocks(ROOT / "docs/megatron.md", None))
      if re.search(r"^(from|import) ", b, flags=re.M)),
    ("docs/example.md", 0, _python_blocks(ROOT / "docs/example.md", None)[0]),
]


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


@pytest.mark.parametrize("where,index,code", SNIPPETS, ids=[f"{w}#{i}" for w, i, _ in SNIPPETS])
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


@pytest.mark.parametrize("where,index,code", SNIPPETS, ids=[f"{w}#{i}" for w, i, _ in SNIPPETS])
def test_snippet_imports_resolve_outside_the_repository(where, index, code, import_outcomes):
    imports = _imports(code)
    assert imports, f"{where} snippet {index} imports nothing"
    if any("megatron.training" in line for line in imports):
        pytest.importorskip("megatron.training", reason="megatron-core < 0.17 ships no megatron.training")
    error = import_outcomes[f"{where}#{index}"]
    assert error is None, f"{where} snippet {index}: {error}"


def test_example_doc_snippet_runs_as_written(tmp_path):
    """docs/example.md's first snippet is self-contained: it builds the flags and the hook (inside a launcher, i.e.
    after the launcher initialised torch.distributed and megatron's parallel state: one gloo rank here)."""
    launcher = (
        "import torch.distributed as dist\n"
        "from megatron.core import parallel_state\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "parallel_state.initialize_model_parallel()\n")
    code = launcher + SNIPPETS[-1][2] + "\nassert callable(forward_backward)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
