"""The predictors' threshold and leave-one-data-set-out test, against brute force and by hand."""

from __future__ import annotations

import itertools
import math
import random

from syncbn_lab.report.predictors import Case, best_threshold, leave_one_out


def brute_hits(points, cut):
    return sum((p.value >= cut) == p.pays for p in points)


def test_threshold_separates_when_it_can():
    points = [Case("a", v, v > 0.6) for v in (0.1, 0.4, 0.5, 0.7, 0.9)]
    t = best_threshold(points)
    assert (t.cut, t.hits, t.of) == (0.6, 5, 5)
    assert math.isclose(t.gap, 0.2)


def test_threshold_ties_go_to_the_widest_gap():
    # 0.2 N, 0.3 P, 0.8 N, 0.9 P: cuts at 0.25 and 0.85 both make 3 of 4; 0.55 makes 2
    points = [Case("a", 0.2, False), Case("a", 0.3, True), Case("a", 0.8, False),
              Case("a", 0.9, True)]  # fmt: skip
    t = best_threshold(points)
    assert t.hits == 3
    assert t.cut in (0.25, 0.85) and math.isclose(t.gap, 0.1)
    assert t.cut == 0.25  # the gaps tie too: the lower cut


def test_no_penalty_anywhere_predicts_none():
    t = best_threshold([Case("a", v, False) for v in (0.1, 0.5)])
    assert t.cut == math.inf and t.hits == 2 and not t.predicts(1e9)


def test_best_threshold_matches_brute_force_on_random_sets():
    rng = random.Random(3)
    for _ in range(200):
        points = [Case("a", round(rng.random(), 2), rng.random() < 0.4)
                  for _ in range(rng.randint(1, 8))]  # fmt: skip
        values = sorted({p.value for p in points})
        every_cut = [-math.inf, math.inf] + [(a + b) / 2 for a, b in itertools.pairwise(values)]
        assert best_threshold(points).hits == max(brute_hits(points, c) for c in every_cut)


def test_leave_one_out_chooses_on_the_others_only():
    points = [
        Case("fashion", 0.85, True), Case("fashion", 0.72, True), Case("fashion", 0.48, False),
        Case("animal", 0.90, True), Case("animal", 0.30, False),
        Case("elpv", 0.60, False), Case("elpv", 0.95, True),
    ]  # fmt: skip
    results = {h.dataset: h for h in leave_one_out(points)}
    assert list(results) == ["animal", "elpv", "fashion"]
    # without elpv: 0.30 N, 0.48 N, 0.72 P, 0.85 P, 0.90 P -> cut 0.60; elpv's 0.60 is at the cut
    assert results["elpv"].threshold.cut == 0.6
    assert (results["elpv"].hits, results["elpv"].of) == (1, 2)  # 0.60 predicted to pay: wrong
    # without fashion: 0.30 N, 0.60 N, 0.90 P, 0.95 P -> cut 0.75: 0.85 P, 0.72 miss, 0.48 N
    assert results["fashion"].threshold.cut == 0.75
    assert (results["fashion"].hits, results["fashion"].of) == (2, 3)
    assert (results["animal"].hits, results["animal"].of) == (2, 2)


def test_one_data_set_has_nothing_to_hold_out():
    assert leave_one_out([Case("a", 0.1, False), Case("a", 0.9, True)]) == []
