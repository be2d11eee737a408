"""docs/batchnorm.md points each formula at a line of functional.py; keep them in sync."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(
    r"^\|[^|]*\| `(?P<code>[^`]+)` \| \[[^\]]+\]\(\.\./(?P<path>[^)#]+)#L(?P<line>\d+)\)"
)


def test_formula_table_points_at_the_right_lines():
    rows = [ROW.match(line) for line in (ROOT / "docs/batchnorm.md").read_text().splitlines()]
    rows = [r for r in rows if r]
    assert len(rows) >= 20
    stale = []
    for row in rows:
        lines = (ROOT / row["path"]).read_text().splitlines()
        line = int(row["line"])
        if row["code"] not in lines[line - 1]:
            stale.append(f"L{line}: {row['code']!r} not in {lines[line - 1].strip()!r}")
    assert not stale, "docs/batchnorm.md is out of date:\n" + "\n".join(stale)
