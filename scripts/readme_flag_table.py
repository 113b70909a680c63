"""Print docs/reference.md's flag table generated from the ``TISConfig`` field declarations; ``--write``
replaces the table in docs/reference.md (the block starting at its ``| flag | meaning and default |`` header) with it.

    python scripts/readme_flag_table.py [--write]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slime_tis.config import ALL_OPTIONS  # noqa: E402
from slime_tis.config_fields import flag_table  # noqa: E402

HEADER = "| flag | meaning and default |"


def readme_table(text: str) -> tuple[int, int]:
    """``(start, end)`` character offsets of the flag table in ``text`` (header to the last row)."""
    start = text.index(HEADER)
    end = start
    for line in text[start:].splitlines(keepends=True):
        if not line.startswith("|"):
            break
        end += len(line)
    return start, end


def main(argv: list[str]) -> int:
    table = flag_table(ALL_OPTIONS)
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
