"""Print docs/reference.md's generated tables: the flag table (from the ``TISConfig`` field declarations) and the
metric table (from ``slime_tis.core.metric_schema.METRICS``); ``--write`` replaces each table in docs/reference.md
(the block of ``|`` lines starting at its header) with the generated one.

    python scripts/reference_tables.py [--write]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slime_tis.config import ALL_OPTIONS  # noqa: E402
from slime_tis.config_fields import flag_table  # noqa: E402
from slime_tis.core.metric_schema import METRIC_TABLE_HEADER, metric_table  # noqa: E402

REFERENCE = ROOT / "docs" / "reference.md"
FLAG_TABLE_HEADER = "| flag | meaning and default |"


def tables() -> dict[str, str]:
    """Each table's header line -> the generated table (header to the last row)."""
    return {FLAG_TABLE_HEADER: flag_table(ALL_OPTIONS), METRIC_TABLE_HEADER: metric_table()}


def splice(text: str, header: str, table: str) -> str:
    """``text`` with the block of ``|`` lines starting at ``header`` replaced by ``table``."""
    start = text.index(header)
    end = start
    for line in text[start:].splitlines(keepends=True):
        if not line.startswith("|"):
            break
        end += len(line)
    return text[:start] + table + text[end:]


def main(argv: list[str]) -> int:
    if "--write" not in argv:
        print("\n".join(tables().values()), end="")
        return 0
    text = REFERENCE.read_text()
    for header, table in tables().items():
        text = splice(text, header, table)
    REFERENCE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
