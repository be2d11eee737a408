"""The report's reading: each claim with its figure, its uncertainty and "holds" or "does
not hold" from the tests in :mod:`syncbn_lab.report.stats`."""

from __future__ import annotations

import math
from collections import defaultdict

from syncbn_lab.report import stats
from syncbn_lab.report.collect import series, test_error, train_loss
from syncbn_lab.report.convergence import THRESHOLDS, batch_stats_error, slower
from syncbn_lab.report.stats import NoiseFloor, by_seed, mean_std, paired
from syncbn_lab.report.study import SMALL_BATCH, Study
from syncbn_lab.report.text import fmt_p, fmt_paired
from syncbn_lab.report.verdicts import holds as verdict
from syncbn_lab.variants import GROUP


def reading(study: Study) -> list[str]:
    lines = _flat_reading(
        study.floor,
        "SyncBN is flat across device counts",
        lambda f: (
            f"its mean test error ranges over {f.spread:.2f} pp across {f.device_counts} "
            f"device counts; the device count explains no more than the noise floor "
            f"({f.std:.2f} pp per run) predicts (two-way ANOVA, seeds as blocks: "
            f"F = {f.f:.2f}, p = {fmt_p(f.p)}, {f.seeds} seeds)."
        ),
    )
    deltas = study.against_largest(study.baseline)
    if deltas:
        threshold = stats.significant_from(deltas)
        series = ", ".join(
            f"{fmt_paired(d)} at {b}" for b, d in sorted(deltas.items(), reverse=True)
        )
        smallest = min(deltas)
        if threshold is None:
            lines.append(
                f"- **Per-device BN degrades as the per-device batch shrinks** — does not "
                f"hold: not even at {smallest} image(s) per device is it significantly worse "
                f"than at {study.largest} (Δ pp by images per device: {series})."
            )
        else:
            d = deltas[threshold]
            lines.append(
                f"- **Per-device BN degrades as the per-device batch shrinks** — holds: "
                f"significantly worse than at {study.largest} images per device (paired "
                f"t-test, p < {stats.ALPHA}) from **{threshold} images per device** down "
                f"({fmt_paired(d)} pp there, p = {fmt_p(d.p)}); Δ pp by images "
                f"per device: {series}."
            )
    lines += recovery_reading(study)
    lines += convergence_reading(study)
    lines += convergence_claims(study)
    lines += normalization_reading(study)
    return lines


def normalization_reading(study: Study) -> list[str]:
    """SyncBN on several devices normalises over the global batch, as bn on one device
    does: against the normalisation batch their points fall on one x, and should agree."""
    several = [r for r in study.runs if r[GROUP] == study.reference and r["devices"] > 1]
    if not several or not study.base:
        return []
    per_seed: dict[int, list[float]] = defaultdict(list)
    for r in several:
        per_seed[r["seed"]].append(r.test_error)
    sync = {s: sum(v) / len(v) for s, v in per_seed.items()}
    d = paired(sync, study.base)
    batch = several[0]["normalization_batch_size"]
    return [
        f"- **Test error follows the normalisation batch** "
        f"(`test_error_vs_normalization_batch.png`: bn and brn move to their per-device "
        f"batch, SyncBN's device counts fall on {batch}) — {verdict(not d.significant)}: "
        f"at {batch} images per normalisation batch, SyncBN on 2 or more devices (mean per "
        f"seed) differs from bn on one device by {fmt_paired(d)} pp (p = {fmt_p(d.p)}, "
        f"n = {d.n})."
    ]


def recovery_reading(study: Study) -> list[str]:
    rows = study.recovery_rows
    lines = []
    for name, label in study.remedy_names():
        mine = [r for r in rows if r["variant"] == name]
        if not mine:
            continue
        lost = [r for r in mine if r["bn_loss"].significant and r["bn_loss"].mean > 0]
        parts = "; ".join(
            f"{r['batch']}: remaining {fmt_paired(r['vs_sync'])} pp of BN's "
            f"{fmt_paired(r['bn_loss'])}"
            + ("" if math.isnan(r["recovered"]) else f" ({100 * r['recovered']:.0f} %)")
            for r in mine
        )
        if not lost:
            lines.append(
                f"- **{label} recovers BN's loss** — nothing to recover: BN is not "
                f"significantly worse than SyncBN at {SMALL_BATCH} or fewer images per "
                f"device here ({parts})."
            )
            continue
        wins = [r for r in lost if r["vs_bn"].significant and r["vs_bn"].mean < 0]
        harms = [r for r in mine if r["vs_bn"].significant and r["vs_bn"].mean > 0]
        where = ", ".join(str(r["batch"]) for r in lost)
        worse = (
            f"; significantly worse than bn at {', '.join(str(r['batch']) for r in harms)}"
            if harms
            else ""
        )
        lines.append(
            f"- **{label} recovers part of BN's loss wherever BN loses** (at {where} images "
            f"per device) — {verdict(len(wins) == len(lost))}: significantly better than "
            f"bn at {', '.join(str(r['batch']) for r in wins) or 'none'} of them{worse} "
            f"(paired t-test, p < {stats.ALPHA}). By images per device: {parts}."
        )
    return lines


def convergence_reading(study: Study) -> list[str]:
    lines = []
    loss = {
        b: mean_std(study.seeds(study.baseline, b, train_loss).values())[0]
        for b in study.batches
        if study.cells.get((study.baseline, b))
    }
    if len(loss) > 1:
        ordered = [loss[b] for b in sorted(loss, reverse=True)]
        rising = all(a < b for a, b in zip(ordered, ordered[1:], strict=False))
        lines.append(
            f"- **Per-device BN's final training loss rises at every halving of the "
            f"per-device batch** — {verdict(rising)}: "
            + ", ".join(f"{loss[b]:.4f} at {b}" for b in sorted(loss, reverse=True))
            + (
                f" (noise floor of one run: {study.loss_floor.std:.4f})."
                if study.loss_floor
                else "."
            )
        )
    lines += _flat_reading(
        study.loss_floor,
        "SyncBN's final training loss is flat across device counts",
        lambda f: (
            f"range {f.spread:.4f} (F = {f.f:.2f}, p = {fmt_p(f.p)}); the curves per device "
            "count are in `train_loss_curves.png`."
        ),
    )
    return lines


def _flat_reading(floor: NoiseFloor | None, claim: str, detail) -> list[str]:
    """The claim that a noise floor's device counts explain nothing ("flat"), with its
    verdict and ``detail(floor)``; nothing when the floor could not be tested."""
    if floor is None or math.isnan(floor.p):
        return []
    return [f"- **{claim}** — {verdict(floor.flat)}: {detail(floor)}"]


def convergence_claims(study: Study) -> list[str]:
    """The reading's lines on convergence speed, test statistics and accumulation."""
    lines = []
    deltas = {b: d for b, d in slower(study).items() if d.n > 1}
    if deltas:
        smallest = min(deltas)
        d = deltas[smallest]
        parts = ", ".join(f"{dd.mean:+,.0f} ± {dd.std:,.0f} at {b}"
                          for b, dd in sorted(deltas.items(), reverse=True))  # fmt: skip
        lines.append(
            f"- **Per-device BN needs more steps to reach {THRESHOLDS[-1]:g} % validation "
            f"accuracy as the per-device batch shrinks** — "
            f"{verdict(d.significant and d.mean > 0)}: at {smallest} images per device "
            f"{d.mean:+,.0f} ± {d.std:,.0f} steps against {study.largest} (paired, "
            f"p = {fmt_p(d.p)}, n = {d.n}); steps more than at {study.largest} by images per "
            f"device: {parts}."
        )
    rows = []
    for b in study.batches:
        cell = study.cells.get((study.baseline, b), [])
        if b <= SMALL_BATCH and any(not math.isnan(batch_stats_error(r)) for r in cell):
            rows.append((b, paired(by_seed(cell, lambda r: batch_stats_error(r)),
                                   by_seed(cell, test_error))))  # fmt: skip
    if rows:
        wins = [b for b, d in rows if d.significant and d.mean < 0]
        lines.append(
            f"- **Testing as it trained (statistics of test batches of the training "
            f"normalisation batch) beats the EMA statistics at {SMALL_BATCH} or fewer images "
            f"per device** — {verdict(len(wins) == len(rows))}: "
            + "; ".join(f"{b}: {fmt_paired(d)} pp (p = {fmt_p(d.p)})" for b, d in rows)
            + "."
        )
    accumulated = series({GROUP: study.baseline, "accumulate": 2})
    pairs = []
    for (name, b), members in study.cells.items():
        devices = study.cells.get((study.baseline, b))
        if name == accumulated and devices:
            pairs.append((b, paired(by_seed(members, test_error), by_seed(devices, test_error))))
    if pairs:
        differ = [b for b, d in pairs if d.significant]
        lines.append(
            f"- **Accumulating gradients over micro-batches costs what the same number of "
            f"devices costs** — {verdict(not differ)}: accumulated minus devices at the same "
            f"normalisation batch, "
            + "; ".join(
                f"{b} images: {fmt_paired(d)} pp (p = {fmt_p(d.p)})"
                for b, d in sorted(pairs, reverse=True)
            )  # fmt: skip
            + f" (paired t-test, p < {stats.ALPHA} would count as a difference)."
        )
    return lines
