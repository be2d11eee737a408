"""The converged study's own sections: how fast each variant converges (steps to reach fixed
validation accuracies), train-test inconsistency (test batches normalised with their own
statistics), gradient accumulation against emulated devices, and which claims of an earlier,
shorter study survive convergence.

Each compares runs seed by seed (:func:`~.stats.paired`) and states its noise; the cells come
from a :class:`~.study.Study`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from syncbn_lab.report.collect import Run, series, steps_to, test_error
from syncbn_lab.report.stats import Paired, by_seed, difference_noise, mean_std, paired
from syncbn_lab.report.study import SMALL_BATCH, Study, per_sample
from syncbn_lab.report.text import fmt, fmt_p, fmt_paired, table_head, table_row
from syncbn_lab.report.verdicts import outcome
from syncbn_lab.variants import GROUP

THRESHOLDS = (85.0, 88.0, 90.0)
"""Validation accuracies (%) whose first crossing the convergence table reports."""


def steps_reached(values: list[float], total: int) -> str:
    """mean ± std of the runs that reached it, and how many of ``total`` did."""
    reached = [v for v in values if not math.isnan(v)]
    if not reached:
        return f"not reached (0/{total})"
    m, s = mean_std(reached)
    return f"{m:,.0f} ± {s:,.0f}" + ("" if len(reached) == total else f" ({len(reached)}/{total})")


def speed_section(study: Study) -> list[str]:
    """Steps to reach each of THRESHOLDS per series and per-device batch."""
    if not any(r.val_curve for r in study.runs):
        return []
    gaps = [b - a for r in study.runs
            for (a, _), (b, _) in zip(r.val_curve, r.val_curve[1:], strict=False)]  # fmt: skip
    every = [statistics.mode(gaps)] if gaps else []  # the usual spacing (an epoch's end adds one)
    lines = [
        "",
        "## How fast each variant converges",
        "",
        "Optimizer steps until the validation accuracy first reaches "
        + ", ".join(f"{t:g} %" for t in THRESHOLDS)
        + " (mean ± std over seeds; the runs that never reach it are counted, not averaged). "
        + (
            f"Validation runs about every {every[0]} steps, so a step count is good to that. "
            if every
            else ""
        )  # fmt: skip
        + "The last column is the last epoch's training loss (its mean over the epoch).",
        "",
        *table_head(
            "variant",
            "images per device",
            *(f"steps to {t:g} %" for t in THRESHOLDS),
            "final training loss",
        ),
    ]
    for (variant, batch), members in sorted(
        study.cells.items(), key=lambda c: (study.variants.index(c[0][0]), -c[0][1])
    ):
        steps = [steps_reached([steps_to(r, t) for r in members], len(members)) for t in THRESHOLDS]
        loss = fmt(*mean_std(r["train_loss"] for r in members), digits=4)
        lines.append(table_row(variant, "–" if per_sample(variant) else batch, *steps, loss))
    return lines


def slower(study: Study, accuracy: float = THRESHOLDS[-1]) -> dict[int, Paired]:
    """Per-device batch -> paired difference in steps to ``accuracy`` of the baseline there
    against the baseline at the largest per-device batch (seeds that reached it in both)."""
    base = by_seed(study.cells.get((study.baseline, study.largest), []),
                   lambda r: steps_to(r, accuracy))  # fmt: skip
    out = {}
    for b in study.batches:
        cell = study.cells.get((study.baseline, b))
        if b != study.largest and cell:
            out[b] = paired(by_seed(cell, lambda r: steps_to(r, accuracy)), base)
    return out


def batch_stats_section(study: Study) -> list[str]:
    """The baseline at the small per-device batches evaluated three ways: EMA running
    statistics, PreciseBN statistics, and the statistics of test batches of its training
    normalisation batch (Wu & Johnson 2021, §4)."""
    rows = []
    for b in study.batches:
        members = study.cells.get((study.baseline, b), [])
        if b > SMALL_BATCH or not any(not math.isnan(batch_stats_error(r)) for r in members):
            continue
        ema = by_seed(members, test_error)
        precise = by_seed(members, lambda r: r.test_error_precise_bn)
        batch = by_seed(members, batch_stats_error)
        rows.append(
            table_row(
                b,
                fmt(*mean_std(ema.values())),
                fmt(*mean_std(precise.values())),
                fmt(*mean_std(batch.values())),
                fmt_paired(paired(precise, ema)),
                fmt_p(paired(precise, ema).p),
                fmt_paired(paired(batch, ema)),
                fmt_p(paired(batch, ema).p),
            )
        )
    if not rows:
        return []
    return [
        "",
        "## Train-test inconsistency: which statistics to test with",
        "",
        f"{study.baseline} trained at a small per-device batch normalises each training "
        "batch with its own statistics; at test time it uses population estimates: the EMA "
        "running statistics, or PreciseBN's recomputation on the final weights. The third "
        "column tests as it trained: each group of test images of its training "
        "normalisation batch normalised with its own statistics (Wu & Johnson 2021, §4). "
        "Test error (%), mean ± std; Δ against EMA paired by seed.",
        "",
        *table_head(
            "images per device",
            "EMA",
            "PreciseBN",
            "test-batch statistics",
            "PreciseBN − EMA (pp)",
            "p",
            "test-batch − EMA (pp)",
            "p",
        ),
        *rows,
    ]


def batch_stats_error(run: Run) -> float:
    """Test error (%) with test-batch statistics (trainer.eval_batch_stats); nan without."""
    acc = run["test_acc_batch_stats"]
    return math.nan if acc is None else 100.0 - acc


def accumulation_section(study: Study) -> list[str]:
    """Runs that accumulate gradients over K micro-batches on one device against the
    baseline on K emulated devices: the same normalisation batch (and, in exact arithmetic,
    the same training; docs/parallel.md), paired by seed."""
    noise = difference_noise(study.floor.std) if study.floor else math.nan
    rows = []
    for (name, b), members in sorted(study.cells.items(), key=lambda c: -c[0][1]):
        if name != series({GROUP: study.baseline, "accumulate": 2}):
            continue
        devices = study.cells.get((study.baseline, b), [])
        d = paired(by_seed(members, test_error), by_seed(devices, test_error))
        loss = paired(by_seed(members, lambda r: r["train_loss"]),
                      by_seed(devices, lambda r: r["train_loss"]))  # fmt: skip
        ratio = f"{d.mean / noise:+.1f}" if noise > 0 else "–"
        rows.append(
            table_row(
                b,
                members[0]["accumulate"],
                fmt(*mean_std(r.test_error for r in members)),
                fmt(*mean_std(r.test_error for r in devices)),
                fmt_paired(d),
                fmt_p(d.p),
                ratio,
                fmt_paired(loss, 4),
                fmt_p(loss.p),
            )  # fmt: skip
        )
    if not rows:
        return []
    return [
        "",
        "## Gradient accumulation shrinks BN's batch as devices do",
        "",
        f"{study.baseline} on one device accumulating the gradients of K micro-batches of the "
        f"global batch against {study.baseline} on K emulated devices: each normalises the "
        "same images together, and in float64 the two train identically, running statistics "
        "aside (tests/train/test_accumulate.py). Δ = accumulated − devices, paired by seed, "
        "against the noise of a difference of two runs"
        + (f" ({noise:.2f} pp)." if noise > 0 else "."),
        "",
        *table_head(
            "images per micro-batch",
            "K",
            "accumulated (%)",
            "K devices (%)",
            "Δ error (pp)",
            "p",
            "Δ / noise",
            "Δ final training loss",
            "p",
        ),
        *rows,
    ]


Claim = tuple[str, Callable[[Study], Paired | None]]


def claims(study: Study) -> list[Claim]:
    """The paired comparisons both studies can make, as (claim, how to compute it)."""
    base, ref = study.baseline, study.reference

    def against(variant: str, b: int, other: str, value=test_error) -> Callable:
        def compute(s: Study) -> Paired | None:
            a, o = s.cells.get((variant, b)), s.reference_seeds(value) if other == ref else (
                by_seed(s.cells.get((other, b), []), value))  # fmt: skip
            return paired(by_seed(a, value), o) if a and o else None

        return compute

    out: list[Claim] = []
    for b in study.batches:
        if b > SMALL_BATCH:
            continue
        out.append((f"{base} at {b} image{'s' * (b > 1)} per device is worse than {ref}",
                    against(base, b, ref)))  # fmt: skip
        for v in study.batch_remedies:
            out.append((f"{v.name} at {b} beats {base}", against(v.name, b, base)))
        out.append((f"PreciseBN at {b} beats EMA statistics",
                    lambda s, b=b: _precise_vs_ema(s, b)))  # fmt: skip
    for v in study.sample_remedies:
        out.append((f"{v.name} beats {base} at {study.smallest_batch}",
                    lambda s, v=v: _sample_vs_bn(s, v.name)))  # fmt: skip
    return out


def _precise_vs_ema(s: Study, b: int) -> Paired | None:
    cell = s.cells.get((s.baseline, b))
    if not cell:
        return None
    return paired(by_seed(cell, lambda r: r.test_error_precise_bn), by_seed(cell, test_error))


def _sample_vs_bn(s: Study, name: str) -> Paired | None:
    members = [r for r in s.runs if r[GROUP] == name]
    cell = s.cells.get((s.baseline, s.smallest_batch))
    if not members or not cell:
        return None
    return paired(by_seed(members, test_error), by_seed(cell, test_error))


def survival_section(study: Study, earlier: Study, earlier_name: str) -> list[str]:
    """Each claim, computed the same way in ``earlier`` (a shorter study of the same grid)
    and in ``study``, with its outcome in each (:func:`outcome`) and whether it changed."""
    lines = [
        "",
        f"## Which claims survive convergence ({earlier_name} against this study)",
        "",
        "Each row is a paired comparison (Δ pp of test error, mean ± std over seeds, paired "
        "t-test p) made the same way in both studies; its outcome is significant (p < 0.05) "
        "in the stated direction (holds), significant the other way (opposite), or neither.",
        "",
        *table_head(
            "claim",
            f"{earlier_name}: Δ (pp)",
            "p",
            "outcome",
            "this study: Δ (pp)",
            "p",
            "outcome",
            "at convergence",
        ),
    ]
    for claim, compute in claims(study):
        before, after = compute(earlier), compute(study)
        sign = 1 if "worse" in claim else -1
        cells = []
        outcomes = []
        for d in (before, after):
            outcomes.append(outcome(d, sign))
            cells += ["–", "–"] if d is None else [fmt_paired(d), fmt_p(d.p)]
            cells.append(outcomes[-1])
        if "not measured" in outcomes:
            change = "–"
        else:
            change = "unchanged" if outcomes[0] == outcomes[1] else " → ".join(outcomes)
        lines.append(table_row(claim, *cells, change))
    return lines
