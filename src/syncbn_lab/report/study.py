"""The figures of one sweep, grouped for the report: cells by variant and per-device batch,
the float32 noise floor, paired differences and the recovery of BN's loss.

Which variant is the baseline, the synchronised reference or a remedy is each variant's
``role`` (``syncbn_lab.variants.with_role``); nothing here names a variant.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import cached_property

from syncbn_lab.report import stats
from syncbn_lab.report.collect import Failure, Run, test_error, test_error_precise_bn
from syncbn_lab.report.stats import Paired, by_seed, mean_std, paired
from syncbn_lab.variants import GROUP, VARIANTS, with_role

SMALL_BATCH = 8
"""Per-device batches at or below this are where the recovery of BN's loss is measured."""
CELLS = (GROUP, "per_device_batch_size")
"""What names a cell of this study: a series (the variant, or its accumulated runs) and a
per-device batch (configs/config.yaml's ``sweep.report.cells``)."""


def group(runs, *keys: str) -> dict[tuple, list]:
    """Runs (or failures) by the values of ``keys``."""
    groups: dict[tuple, list] = defaultdict(list)
    for run in runs:
        groups[tuple(run[k] for k in keys)].append(run)
    return groups


def variant_order(runs) -> list[str]:
    """The variants of ``runs`` in registry order, unknown ones after them (sorted)."""
    present = {r[GROUP] for r in runs}
    return [v for v in VARIANTS if v in present] + sorted(present - set(VARIANTS))


def per_sample(name: str) -> bool:
    """Whether the variant called ``name`` normalises each sample alone (batch-independent)."""
    return name in VARIANTS and VARIANTS[name].per_sample


class Study:
    """Emulated (or single-device) ``runs``, real DDP ``ddp`` runs and the ``failures`` of a
    sweep, with the figures the tables and the reading quote."""

    def __init__(self, runs: list[Run], ddp: list[Run], failures: list[Failure]):
        self.runs, self.ddp, self.failures = runs, ddp, failures
        self.variants = variant_order(runs)
        self.baseline = with_role("baseline")[0].name  # per-device BN
        self.reference = with_role("reference")[0].name  # SyncBN
        remedies = with_role("remedy")
        self.batch_remedies = [v for v in remedies if not v.per_sample]
        self.sample_remedies = [v for v in remedies if v.per_sample]
        self.cells = group(runs, *CELLS)
        self.failed_cells = group(failures, *CELLS)
        batches = {r["per_device_batch_size"] for r in runs if not per_sample(r[GROUP])}
        batches |= {f["per_device_batch_size"] for f in failures if f[GROUP] in self.variants}
        self.batches = sorted((b for b in batches if isinstance(b, int)), reverse=True)
        self.per_sample_runs = [r for r in runs if per_sample(r[GROUP])]
        floors = stats.reference_noise(runs) or {}
        self.floor, self.loss_floor = floors.get("test_error"), floors.get("train_loss")
        base_batches = [b for b in self.batches if self.cells.get((self.baseline, b))]
        self.largest = base_batches[0] if base_batches else None
        self.smallest_batch = self.batches[-1] if self.batches else None
        self.base = by_seed(self.cells.get((self.baseline, self.largest), []), test_error)

    def seeds(self, variant: str, batch: int, value=test_error) -> dict[int, float]:
        return by_seed(self.cells.get((variant, batch), []), value)

    def reference_seeds(self, value=test_error) -> dict[int, float]:
        """seed -> the reference's mean over its device counts: one model at every device
        count (proven in float64), so the mean is the least noisy reference of a seed."""
        per_seed: dict[int, list[float]] = defaultdict(list)
        for r in self.runs:
            v = value(r)
            if r[GROUP] == self.reference and v is not None and not math.isnan(v):
                per_seed[r["seed"]].append(v)
        return {s: sum(v) / len(v) for s, v in per_seed.items()}

    def against_largest(self, variant: str) -> dict[int, Paired]:
        """Per-device batch -> paired test error difference against the baseline at the
        largest per-device batch (one device: every batch-dependent variant is then the same
        model)."""
        out = {}
        for b in self.batches:
            if b == self.largest or not self.cells.get((variant, b)):
                continue
            out[b] = paired(self.seeds(variant, b), self.base)
        return out

    def remedy_names(self) -> list[tuple[str, str]]:
        """(row name in the recovery table, label in the reading), in reading order: the
        batch remedies with their EMA statistics, the baseline with PreciseBN, the
        per-sample remedies."""
        return (
            [(f"{v.name} (EMA)", v.label) for v in self.batch_remedies]
            + [(f"{self.baseline} (PreciseBN)", "PreciseBN")]
            + [(v.name, v.label) for v in self.sample_remedies]
        )

    @cached_property
    def recovery_rows(self) -> list[dict]:
        """At each small per-device batch: the baseline's loss against the reference (its
        mean over device counts, per seed), and what PreciseBN and each remedy make of it."""
        rows = []
        sample = {v.name: by_seed(group(self.runs, GROUP)[(v.name,)], test_error)
                  for v in self.sample_remedies}  # fmt: skip
        base, sync = self.baseline, self.reference_seeds()
        for b in self.batches:
            if b > SMALL_BATCH or not self.cells.get((base, b)) or not sync:
                continue
            bn = self.seeds(base, b)
            bn_loss = paired(bn, sync)
            candidates = {f"{base} (PreciseBN)": self.seeds(base, b, test_error_precise_bn)}
            for v in self.batch_remedies:
                candidates[f"{v.name} (EMA)"] = self.seeds(v.name, b)
                candidates[f"{v.name} (PreciseBN)"] = self.seeds(v.name, b, test_error_precise_bn)
            candidates.update(sample)
            for name, values in candidates.items():
                if not values:
                    continue
                vs_sync = paired(values, sync)
                rows.append(
                    {
                        "batch": b,
                        "variant": name,
                        "error": mean_std(values.values()),
                        "bn_loss": bn_loss,
                        "vs_sync": vs_sync,
                        "vs_bn": paired(values, bn),
                        "recovered": stats.recovered(bn_loss.mean, vs_sync.mean),
                    }
                )
        return rows
