"""The published figures a report sets its study against, read from papers.yaml (each with
the paper and table it is printed in), so no figure is written in code."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

PAPERS = Path(__file__).with_name("papers.yaml")


@cache
def papers() -> dict[str, dict[str, Any]]:
    """papers.yaml as a mapping: paper key -> its source, setting and figures."""
    return yaml.safe_load(PAPERS.read_text())


def mark(paper: dict[str, Any]) -> str:
    """What a figure is marked with where it was not checked against the paper's text here."""
    return "" if paper.get("confirmed", True) else " (not checked against the paper)"
