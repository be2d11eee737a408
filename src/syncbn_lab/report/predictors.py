"""Whether a figure a user reads off their own run predicts the penalty on a data set it was not
chosen on (reports/nbs_penalty/PREDICTORS.md fixes the rules before the runs).

A predictor gives each configuration one number; a configuration either pays a penalty or not.
:func:`best_threshold` chooses the cut that classifies a set of configurations best (a value at
or above the cut predicts a penalty); :func:`leave_one_out` chooses it on every data set but one
and counts the hits on the one left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """One configuration as a predictor sees it: its data set, its value, whether it pays a
    penalty, and the penalty (pp)."""

    dataset: str
    value: float
    pays: bool
    penalty: float = math.nan


@dataclass(frozen=True)
class Threshold:
    """A cut (``inf``: predict no penalty anywhere; ``-inf``: everywhere), how many of the
    configurations it was chosen on it classifies correctly, and the gap it sits in."""

    cut: float
    hits: int
    of: int
    gap: float

    def predicts(self, value: float) -> bool:
        return value >= self.cut


def best_threshold(points: Sequence[Case]) -> Threshold:
    """The cut with the most correct classifications of ``points``; ties go to the widest gap
    between adjacent sorted values (the cut at its middle), then to the lower cut. The cuts
    below and above every value (predict a penalty everywhere, nowhere) have no gap."""
    values = sorted({p.value for p in points})
    candidates = [(-math.inf, 0.0), (math.inf, 0.0)]
    candidates += [((a + b) / 2, b - a) for a, b in zip(values, values[1:], strict=False)]

    def hits(cut: float) -> int:
        return sum((p.value >= cut) == p.pays for p in points)

    cut, gap = max(candidates, key=lambda c: (hits(c[0]), c[1], -c[0]))
    return Threshold(cut, hits(cut), len(points), gap)


@dataclass(frozen=True)
class HeldOut:
    """One data set left out: the threshold chosen on the others and its hits on this one."""

    dataset: str
    threshold: Threshold
    hits: int
    of: int


def leave_one_out(points: Sequence[Case]) -> list[HeldOut]:
    """For each data set in turn (sorted), the threshold :func:`best_threshold` chooses on the
    other data sets' configurations and how many of this data set's it predicts right."""
    out = []
    for dataset in sorted({p.dataset for p in points}):
        held = [p for p in points if p.dataset == dataset]
        rest = [p for p in points if p.dataset != dataset]
        if not rest:
            continue
        threshold = best_threshold(rest)
        hits = sum(threshold.predicts(p.value) == p.pays for p in held)
        out.append(HeldOut(dataset, threshold, hits, len(held)))
    return out
