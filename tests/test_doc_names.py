"""Every plugin flag, YAML key and metric a user page names exists.

README.md and docs/*.md are scanned line by line:

* a ``--tis-*`` flag must be one the plugin's parsers declare (``slime_tis.arguments.add_tis_arguments``, the
  Megatron-LM hook's ``add_megatron_tis_arguments``, ``train_rl.py``'s ``add_megatron_rl_tis_arguments``) or
  one of slime's own (``tests/_slime_args.FLAGS``: ``--tis-clip``, ``--tis-clip-low``);
* a YAML key ``tis_*:`` (a key followed by a colon, as in a slime config file) must be a dest of those parsers
  or of slime's flags, or a key the slime hooks read (``slime_tis.slime.config``'s table);
* a metric ``tis/*``, ``policy/*``, ``moe/*`` or ``sglang/*`` must be a row of the metric schema
  (``core.metric_schema``: ``METRICS``, ``ROUTING_ROWS``, the staleness rows with their ``{b}`` label), or one
  of the host-side metrics declared next to their code (the SGLang reader's, ``train_rl.py``'s appended-token
  count).

A placeholder (``tis/*``, ``tis/<metric>``, a brace list ``tis/staleness_<b>/{kl, k3_kl}``) and a path
(``sglang/srt/...``) are not names.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from _slime_args import FLAGS as SLIME_FLAGS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--tis-[a-z0-9-]*[a-z0-9]")
YAML_KEY = re.compile(r"(?<![\w./-])(tis_[a-z0-9_]+)\s*:(?!:)")
METRIC = re.compile(r"(?<![\w./-])((?:tis|policy|moe|sglang)/[A-Za-z0-9_{}<>*./-]*[A-Za-z0-9_}>*])")


def _plugin_parser() -> argparse.ArgumentParser:
    from slime_tis.arguments import add_tis_arguments
    from slime_tis.megatron.arguments import add_megatron_tis_arguments
    from slime_tis.megatron_rl.host import add_megatron_rl_tis_arguments

    parser = argparse.ArgumentParser(conflict_handler="resolve")
    for add in (add_tis_arguments, add_megatron_tis_arguments, add_megatron_rl_tis_arguments):
        add(parser)
    return parser


def _hook_keys() -> set[str]:
    """The YAML keys slime's hooks read from its namespace with no flag of their own (``tis_dump_dir``,
    ``tis_metrics_path`` ...): ``slime_tis.slime.config``'s table of what the hooks read."""
    from slime_tis.slime.config import _SLIME

    return set(_SLIME)


def _flags_and_dests() -> tuple[set[str], set[str]]:
    parser = _plugin_parser()
    flags = {s for a in parser._actions for s in a.option_strings} | set(SLIME_FLAGS)
    dests = {a.dest for a in parser._actions} | {f.dest for f in SLIME_FLAGS.values()} | _hook_keys()
    return flags, dests


def _metrics() -> tuple[set[str], list[re.Pattern]]:
    from slime_tis.core.metric_schema import METRICS, ROUTING_ROWS, STALENESS_ROWS
    from slime_tis.megatron_rl.host import APPENDED_METRIC
    from slime_tis.sglang.response import FINISH_ERROR_METRICS
    from slime_tis.sglang.support import SUPPORT_INVALID_METRIC
    from slime_tis.sglang.trajectory import READER_METRICS

    names = {m.name for m in (*METRICS, *ROUTING_ROWS)} | {APPENDED_METRIC, SUPPORT_INVALID_METRIC}
    names |= set(FINISH_ERROR_METRICS.values()) | set(READER_METRICS)
    # a staleness row with its label: a bucket number, "<N>plus", or the placeholder {b} / <b>
    label = r"(?:\d+|\d+plus|\{b\}|<b>)"
    patterns = [re.compile(re.escape(m.name).replace(re.escape("{b}"), label) + "$") for m in STALENESS_ROWS]
    return names, patterns


def _is_placeholder(name: str) -> bool:
    return ("*" in name or name.endswith((">", "/")) or name.startswith("sglang/srt")
            or re.search(r"\{(?!b\})", name) is not None)  # a brace list: tis/staleness_<b>/{kl, k3_kl}


def _stale_names() -> list[str]:
    flags, dests = _flags_and_dests()
    metrics, staleness = _metrics()
    out = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{n}"
            out += [f"{where}: flag {f}" for f in FLAG.findall(line) if f not in flags]
            out += [f"{where}: YAML key {k}" for k in YAML_KEY.findall(line) if k not in dests]
            for name in METRIC.findall(line):
                name = name.rstrip(".")
                if _is_placeholder(name) or name in metrics or any(p.match(name) for p in staleness):
                    continue
                out.append(f"{where}: metric {name}")
    return out


def test_every_named_flag_key_and_metric_exists():
    stale = _stale_names()
    assert not stale, "names that do not exist:\n" + "\n".join(stale)


def test_every_flag_named_in_the_code_exists():
    """Docstrings and error messages of the plugin name only flags that exist (a user reads them in ``help()``
    and in the one-line errors)."""
    flags, _ = _flags_and_dests()
    stale = [f"{path.relative_to(ROOT)}:{n}: flag {f}"
             for path in sorted((ROOT / "slime_tis").rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for f in FLAG.findall(line) if f not in flags]
    assert not stale, "flags that do not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize("line, kind", [
    ("use `--tis-policy-loss ppo_clip`", "flag"),
    ("tis_upper_bnd: 2.0", "YAML key"),
    ("watch `tis/k3kl` rise", "metric"),
    ("watch `moe/routing_mismatches`", "metric"),
])
def test_the_scan_catches_a_stale_name(line, kind, tmp_path, monkeypatch):
    """The scan is not vacuous: a page with one misspelt name fails it, naming the line."""
    page = tmp_path / "page.md"
    page.write_text("fine: `--tis-level sequence`, `tis/k3_kl`, tis_mode: mask\n" + line + "\n", encoding="utf-8")
    monkeypatch.setitem(globals(), "PAGES", [page])
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    stale = _stale_names()
    assert len(stale) == 1 and stale[0].startswith("page.md:2:") and kind in stale[0], stale


def test_troubleshooting_covers_every_metric():
    """docs/troubleshooting.md gives ranges for every tis/ and policy/ metric of the schema (a new metric needs
    its row)."""
    from slime_tis.core.metric_schema import METRICS

    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    assert [m.name for m in METRICS if f"`{m.name}`" not in text] == []


LINK = re.compile(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than ``-`` and ``_`` dropped, spaces -> ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # a '#' line in a code block is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def test_every_link_to_a_section_names_one_that_exists():
    """A link ``page.md#section`` (or ``#section`` on the same page) names a heading of that page."""
    broken = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for target, anchor in LINK.findall(line):
                dest = (page.parent / target).resolve() if target else page
                if not dest.exists() or anchor not in _anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}:{n}: {target}#{anchor}")
    assert not broken, "links to sections that do not exist:\n" + "\n".join(broken)


FENCE = re.compile(r"^<!-- fragment: [^\n]*?\(([^)\n]*)\)[^\n]*-->\n```python[ \t]*\n(.*?)^```", re.M | re.S)


def _free_names(code: str) -> set[str]:
    """Names a snippet reads that it neither imports, assigns nor defines (nor are builtins)."""
    import ast

    from test_doc_snippets import _free_names as free_in_tree

    return free_in_tree(ast.parse(code))


def _fragment_names() -> list[tuple[str, set[str], set[str]]]:
    """``(where, names the marker lists, names the snippet takes from outside)`` of every python fragment whose
    marker lists the names it stands in (``<!-- fragment: inside a launcher (args, model, M) -->``)."""
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            listed = {item.split(":")[0].strip() for item in m.group(1).split(",")}
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            out.append((where, listed, _free_names(m.group(2))))
    return out


def test_every_snippet_uses_only_the_names_its_marker_lists():
    """A python fragment's marker says which of the launcher's names it uses; it uses no other (``providers``
    stands for the ``*_provider`` functions). A snippet that names ``T`` or ``rollout_iterator`` while its marker
    says ``rollout_it`` fails here."""
    found = _fragment_names()
    assert len(found) >= 8
    bad = []
    for where, listed, free in found:
        extra = {n for n in free - listed if not ("providers" in listed and n.endswith("_provider"))}
        if extra:
            bad.append(f"{where}: uses {sorted(extra)}, its marker lists {sorted(listed)}")
    assert not bad, "\n".join(bad)
