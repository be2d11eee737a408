"""How every report writes a figure and a table: mean ± std over seeds, a paired difference,
a p-value, a markdown row. One place, so that the same number reads the same in every
report."""

from __future__ import annotations

import math
from collections.abc import Iterable

from syncbn_lab.report.stats import Paired, mean_std


def fmt(mean: float, std: float, digits: int = 2) -> str:
    """mean ± std; – for nothing to average."""
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def over_seeds(values: Iterable[float | None], digits: int = 2) -> str:
    """mean ± std over seeds; one seed's value alone (it has no spread to state)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (one seed)"
    return fmt(*mean_std(values), digits=digits)


def fmt_p(p: float) -> str:
    return "–" if math.isnan(p) else f"{p:.2g}"


def fmt_paired(d: Paired, digits: int = 2, count: bool = False) -> str:
    """A paired difference as mean ± std over seeds (``count``: and how many); one seed's
    difference alone (it has no spread to state)."""
    if d.n == 0:
        return "–"
    if d.n == 1:
        return f"{d.mean:+.{digits}f} (one seed)"
    return f"{d.mean:+.{digits}f} ± {d.std:.{digits}f}" + (f" (n={d.n})" if count else "")


def fmt_interval(d: Paired, digits: int = 2) -> str:
    """The 95 % interval of a paired difference's mean (t over its seeds); – below two."""
    half = d.half_interval
    if math.isnan(half):
        return "–"
    return f"{d.mean - half:+.{digits}f} to {d.mean + half:+.{digits}f}"


def table_row(*cells: object) -> str:
    """One markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def table_head(*names: object) -> list[str]:
    """A markdown table's header row and the row under it."""
    return [table_row(*names), "|" + "---|" * len(names)]


def sentence(words: str) -> str:
    """``words`` opening a sentence: its first letter upper case (a variant's label)."""
    return words[:1].upper() + words[1:]
