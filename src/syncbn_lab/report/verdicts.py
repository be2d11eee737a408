"""The words a report reads a test with, each written once: a claim holds or does not, a
paired difference is within the float32 noise or differs, a cell reaches another's result,
a directed claim holds or comes out the opposite way.

Every difference is read against the noise of a difference of two float32 runs
(:func:`~.stats.difference_noise`); the tests are the paired t-tests of :mod:`~.stats`.
"""

from __future__ import annotations

import math

from syncbn_lab.report.stats import ALPHA, Paired

HOLDS, DOES_NOT_HOLD, NOT_YET = "holds", "does not hold", "not yet"


def holds(flag: bool) -> str:
    return HOLDS if flag else DOES_NOT_HOLD


def against_noise(d: Paired, noise: float, p: float | None = None) -> str:
    """A paired difference read: its significance (the test's own p, or ``p``: one adjusted
    for a family of tests) and its size against ``noise``."""
    if d.n < 2:
        return NOT_YET
    p = d.p if p is None else p
    beyond = abs(d.mean) > noise
    if not math.isnan(p) and p < ALPHA:
        return "differs" if beyond else "differs, by less than the noise"
    return "not significant, beyond the noise" if beyond else "within the noise"


def reaches(d: Paired, noise: float) -> str:
    """Whether a cell reaches another's result (``d``: its test error less the other's): holds
    when the mean difference is within the noise of a difference, holds and beats it when it is
    significantly below beyond the noise, does not hold when it is significantly above, and is
    undecided otherwise (a gap beyond the noise that the seeds cannot yet resolve)."""
    if d.n < 2:
        return NOT_YET
    if abs(d.mean) <= noise:
        return HOLDS
    if d.significant and d.mean < 0:  # a test error below the other's: beyond reaching it
        return "holds, and beats it"
    return DOES_NOT_HOLD if d.significant else "undecided (more seeds)"


def outcome(d: Paired | None, sign: int = 1) -> str:
    """A directed claim (``sign`` +1: the difference is positive) read by its paired test:
    holds (significant in its direction), opposite (significant the other way), not
    significant, or not measured."""
    if d is None or d.n == 0:
        return "not measured"
    if not d.significant:
        return "not significant"
    return HOLDS if sign * d.mean > 0 else "opposite"
