"""Print docs/reference.md's metric table generated from the metric schema
(``slime_tis.core.metric_schema.METRICS``); ``--write`` replaces the table in docs/reference.md (the block
starting at its ``| metric | formula |`` header) with it.

    python scripts/readme_metric_table.py [--write]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slime_tis.core.metric_schema import METRIC_TABLE_HEADER, metric_table  # noqa: E402


def readme_table(text: str) -> tuple[int, int]:
    """``(start, end)`` character offsets of the metric table in ``text`` (header to the last row)."""
    start = text.index(METRIC_TABLE_HEADER)
    end = start
    for line in text[start:].splitlines(keepends=True):
        if not line.startswith("|"):
            break
        end += len(line)
    return start, end


def main(argv: list[str]) -> int:
    table = metric_table()
    if "--write" not in argv:
        print(table, end="")
        return 0
    readme = ROOT / "docs" / "reference.md"
    text = readme.read_text()
    start, end = readme_table(text)
    readme.write_text(text[:start] + table + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
