"""Write results.csv, README.md (tables, paired tests, the cost table, a reading) and plots.

The reading is generated from the runs: each claim is stated with its figure, its
uncertainty and "holds" or "does not hold" from the tests in :mod:`syncbn_lab.report.stats`.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from functools import cached_property
from pathlib import Path

from syncbn_lab.errors import UserError
from syncbn_lab.report import stats
from syncbn_lab.report.collect import CSV_COLUMNS, Failure, Run
from syncbn_lab.report.plots import write_plots
from syncbn_lab.report.stats import Paired, by_seed, mean_std, paired

# Wu & He, "Group Normalization" (ECCV 2018), Table 3: ResNet-50 on ImageNet, BN computed
# per GPU, validation error (%) by images per GPU; GroupNorm stays at about 24.1 %.
GN_PAPER_BN_ERROR = {32: 23.6, 16: 23.7, 8: 24.8, 4: 27.3, 2: 34.7}
GN_PAPER_GN_ERROR = 24.1
VARIANT_ORDER = ("bn", "brn", "sync", "torch_sync", "gn")
SMALL_BATCH = 8
"""Per-device batches at or below this are where the recovery of BN's loss is measured."""
NOTES = "NOTES.md"
"""Hand-written observations kept next to a report (not regenerated); linked when present."""


def test_error(run: Run) -> float:
    return run.test_error


def test_error_precise_bn(run: Run) -> float:
    return run.test_error_precise_bn


def train_loss(run: Run) -> float:
    return run["train_loss"]


def fmt(mean: float, std: float, digits: int = 2) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def fmt_p(p: float) -> str:
    return "–" if math.isnan(p) else f"{p:.2g}"


def fmt_paired(d: Paired, digits: int = 2) -> str:
    if d.n == 0:
        return "–"
    return f"{d.mean:+.{digits}f} ± {d.std:.{digits}f}"


def verdict(holds: bool) -> str:
    return "holds" if holds else "does not hold"


def group(runs, *keys: str) -> dict[tuple, list]:
    groups: dict[tuple, list] = defaultdict(list)
    for run in runs:
        groups[tuple(run[k] for k in keys)].append(run)
    return groups


def write_report(
    runs: list[Run],
    out_dir: Path,
    title: str,
    sweep_wall_time_s: float | None = None,
    failures: list[Failure] = (),
) -> None:
    """results.csv, README.md and the plots of ``runs`` into ``out_dir``; the cells of
    ``failures`` are marked missing, with each failed run's one-line reason."""
    _check_normalization_batch(runs)  # before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    emulated_or_single = [r for r in runs if r["parallel"] != "ddp"]
    ddp = [r for r in runs if r["parallel"] == "ddp"]
    main = emulated_or_single or runs
    _write_csv(runs, out_dir / "results.csv")
    plots = write_plots(main, out_dir, _variants(main))
    report = Report(main, ddp if emulated_or_single else [], list(failures))
    text = report.markdown(title, plots, sweep_wall_time_s)
    if (out_dir / NOTES).exists():
        text += (
            f"\nHow the study was designed and more observations, by hand: [{NOTES}]({NOTES}).\n"
        )
    (out_dir / "README.md").write_text(text)


def _check_normalization_batch(runs: list[Run]) -> None:
    lacking = [r for r in runs if not isinstance(r["normalization_batch_size"], int)]
    if lacking:
        raise UserError(
            f"{len(lacking)} run(s) have no normalization_batch_size in summary.json (e.g. "
            f"{lacking[0].run_dir}); rerun them with the current code"
        )


def _write_csv(runs: list[Run], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for run in sorted(runs, key=lambda r: (r["bn"], r["parallel"], r["devices"], r["seed"])):
            writer.writerow(run.row())


def _variants(runs: list[Run]) -> list[str]:
    present = {r["bn"] for r in runs}
    return [v for v in VARIANT_ORDER if v in present] + sorted(present - set(VARIANT_ORDER))


class Report:
    """The figures of one sweep: emulated (or single-device) ``runs``, real ``ddp`` runs."""

    def __init__(self, runs: list[Run], ddp: list[Run], failures: list[Failure]):
        self.runs, self.ddp, self.failures = runs, ddp, failures
        self.variants = _variants(runs)
        self.cells = group(runs, "bn", "per_device_batch_size")
        self.failed_cells = group(failures, "bn", "per_device_batch_size")
        batches = {r["per_device_batch_size"] for r in runs if r["bn"] != "gn"}
        batches |= {f["per_device_batch_size"] for f in failures if f["bn"] in self.variants}
        self.batches = sorted((b for b in batches if isinstance(b, int)), reverse=True)
        self.gn = [r for r in runs if r["bn"] == "gn"]
        sync = [r for r in runs if r["bn"] == "sync"]
        self.floor = stats.noise_floor(sync, test_error) if sync else None
        self.loss_floor = stats.noise_floor(sync, train_loss) if sync else None
        bn_batches = [b for b in self.batches if self.cells.get(("bn", b))]
        self.largest = bn_batches[0] if bn_batches else None
        self.base = by_seed(self.cells.get(("bn", self.largest), []), test_error)

    def seeds(self, variant: str, batch: int, value=test_error) -> dict[int, float]:
        return by_seed(self.cells.get((variant, batch), []), value)

    def against_largest(self, variant: str) -> dict[int, Paired]:
        """Per-device batch -> paired test error difference against per-device BN at the
        largest per-device batch (one device: every variant but gn is then the same model)."""
        out = {}
        for b in self.batches:
            if b == self.largest or not self.cells.get((variant, b)):
                continue
            out[b] = paired(self.seeds(variant, b), self.base)
        return out

    # -- the document ------------------------------------------------------------
    def markdown(self, title: str, plots: list[str], wall_time_s: float | None) -> str:
        any_run = self.runs[0]
        seeds = sorted({r["seed"] for r in self.runs})
        commits = sorted({r["git_commit"][:7] for r in self.runs + self.ddp if r["git_commit"]})
        lines = [
            f"# {title}",
            "",
            f"{any_run['model']} on {any_run['dataset']}, global batch "
            f"{any_run['global_batch_size']}, {len(seeds)} seed(s) "
            f"({', '.join(map(str, seeds))}), {len(self.runs) + len(self.ddp)} runs, parallel "
            f"mode(s): {', '.join(sorted({r['parallel'] for r in self.runs + self.ddp}))}, "
            f"precision {any_run['precision'] or 'fp32'}, "
            f"commit {', '.join(commits) or 'unknown'}.",
        ]
        if wall_time_s is not None:
            lines.append(f"The sweep took {wall_time_s / 60:.1f} minutes of wall time.")
        if self.failures:
            lines += _missing_section(self.failures)
        lines += self.error_table()
        lines += self.noise_section()
        lines += self.paired_section()
        lines += self.recovery_section()
        lines += self.loss_table()
        if self.ddp:
            lines += self.cost_section()
            lines += self.spot_check_section()
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
        lines += self.anchors_section()
        lines += ["", "## Reading", ""] + self.reading()
        return "\n".join(lines) + "\n"

    def error_table(self) -> list[str]:
        shown = [v for v in self.variants if v != "gn"]
        lines = ["", "## Test error (%), mean ± std over seeds", ""]
        header = "| images per device | " + " | ".join(
            f"{v} (EMA) | {v} (PreciseBN)" for v in shown
        )
        lines += [header + " |", "|" + "---|" * (1 + 2 * len(shown))]
        for b in self.batches:
            row = [str(b)]
            for v in shown:
                members = self.cells.get((v, b), [])
                note = _missing_note(self.failed_cells.get((v, b), []), bool(members))
                row.append(fmt(*mean_std([r.test_error for r in members])) + note)
                row.append(fmt(*mean_std([r.test_error_precise_bn for r in members])) + note)
            lines.append("| " + " | ".join(row) + " |")
        counts = sorted({len(m) for (v, _), m in self.cells.items() if v != "gn"})
        lines += ["", f"Seeds per cell: {', '.join(map(str, counts))}."]
        if self.gn:
            lines.append(
                f"GroupNorm (batch-independent, run once per seed): "
                f"{fmt(*mean_std([r.test_error for r in self.gn]))} % test error "
                f"(n = {len(self.gn)})."
            )
        return lines

    def noise_section(self) -> list[str]:
        if self.floor is None:
            return []
        f, loss = self.floor, self.loss_floor
        return [
            "",
            "## The float32 noise floor",
            "",
            "SyncBN runs of one seed at different device counts are the same model in exact "
            "arithmetic (proven in float64 by tests/parallel and reports/exactness), so their "
            "spread is float32 rounding amplified by training. Pooled within-seed standard "
            f"deviation of one run ({f.seeds} seeds × {f.device_counts} device counts, "
            f"{f.df} degrees of freedom): **{f.std:.2f} pp** in test error, "
            f"{loss.std:.4f} in the final training loss. A difference of two runs has a noise "
            f"of √2 × that: {math.sqrt(2) * f.std:.2f} pp.",
        ]

    def paired_section(self) -> list[str]:
        lines = [
            "",
            f"## Against per-device BN at {self.largest} images per device (same seed)",
            "",
            "Δ = test error minus that of the bn run at the largest per-device batch with the "
            "same seed (mean ± std over seeds, percentage points); p from a paired t-test; "
            "the last column sets Δ against the noise of a difference of two runs.",
            "",
            "| variant | images per device | normalisation batch | n | Δ error (pp) | p | "
            "Δ / noise |",
            "|---|---|---|---|---|---|---|",
        ]
        noise = math.sqrt(2) * self.floor.std if self.floor else 0.0
        for v in self.variants:
            for b, d in self.against_largest(v).items():
                norm = self.cells[(v, b)][0]["normalization_batch_size"]
                ratio = f"{d.mean / noise:+.1f}" if noise > 0 else "–"
                lines.append(
                    f"| {v} | {b} | {norm} | {d.n} | {fmt_paired(d)} | {fmt_p(d.p)} | {ratio} |"
                )
        return lines

    @cached_property
    def recovery_rows(self) -> list[dict]:
        """At each small per-device batch: BN's loss against SyncBN at the same device count,
        and what PreciseBN, Batch Renormalization and GroupNorm make of it."""
        rows = []
        gn = by_seed(self.gn, test_error)
        for b in self.batches:
            if b > SMALL_BATCH or not self.cells.get(("bn", b)) or not self.cells.get(("sync", b)):
                continue
            sync = self.seeds("sync", b)
            bn = self.seeds("bn", b)
            bn_loss = paired(bn, sync)
            candidates = {
                "bn (PreciseBN)": self.seeds("bn", b, test_error_precise_bn),
                "brn (EMA)": self.seeds("brn", b),
                "brn (PreciseBN)": self.seeds("brn", b, test_error_precise_bn),
                "gn": gn,
            }
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

    def recovery_section(self) -> list[str]:
        rows = self.recovery_rows
        if not rows:
            return []
        lines = [
            "",
            f"## Recovering BN's loss at {SMALL_BATCH} or fewer images per device",
            "",
            "BN's loss = bn's test error minus SyncBN's at the same device count and seed. Each "
            "remedy is compared, seed by seed, with SyncBN (its remaining loss) and with bn "
            "(what it wins); recovered = 1 − remaining / BN's loss.",
            "",
            "| images per device | BN's loss (pp) | p | remedy | error (%) | remaining vs sync "
            "(pp) | p | vs bn (pp) | p | recovered |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            rec = "–" if math.isnan(row["recovered"]) else f"{100 * row['recovered']:.0f} %"
            lines.append(
                f"| {row['batch']} | {fmt_paired(row['bn_loss'])} | {fmt_p(row['bn_loss'].p)} | "
                f"{row['variant']} | {fmt(*row['error'])} | {fmt_paired(row['vs_sync'])} | "
                f"{fmt_p(row['vs_sync'].p)} | {fmt_paired(row['vs_bn'])} | "
                f"{fmt_p(row['vs_bn'].p)} | {rec} |"
            )
        return lines

    def loss_table(self) -> list[str]:
        lines = ["", "## Final training loss (mean over the last epoch), mean ± std", ""]
        lines += [
            "| images per device | " + " | ".join(self.variants) + " |",
            "|" + "---|" * (1 + len(self.variants)),
        ]
        for b in self.batches:
            row = [str(b)]
            for v in self.variants:
                members = self.cells.get((v, b), [])
                row.append(fmt(*mean_std([r["train_loss"] for r in members]), digits=4))
            lines.append("| " + " | ".join(row) + " |")
        return lines

    def cost_section(self) -> list[str]:
        cells = group(self.ddp, "bn", "devices")
        reference = {
            d: mean_std([r["step_time_s"] for r in m])[0]
            for (v, d), m in cells.items()
            if v == "bn"
        }
        lines = [
            "",
            "## Cost under real DDP (gloo, CPU processes on this machine)",
            "",
            "Step time: training time over optimizer steps of rank 0 (data loading included; "
            "1 thread per rank). Bytes: what each rank hands to collectives per step, counted "
            "at the calls (syncbn_lab.traffic): gradient buckets, DDP's broadcast of rank 0's "
            "buffers, SyncBN's statistics. A ring all-reduce puts about 2 (N − 1) / N of its "
            "payload on the wire per rank.",
            "",
            "| bn | ranks | runs | step time (ms) | × bn | bytes per step | gradients | buffers "
            "| norm statistics | collectives per step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        order = {v: i for i, v in enumerate(VARIANT_ORDER)}
        for (v, d), members in sorted(
            cells.items(), key=lambda c: (c[0][1], order.get(c[0][0], 9))
        ):
            step = mean_std([r["step_time_s"] for r in members])[0]
            ratio = f"{step / reference[d]:.2f}" if reference.get(d) else "–"

            def per_step(key: str, members=members) -> str:
                value = mean_std([r[key] for r in members])[0]
                return "–" if math.isnan(value) else f"{value:,.0f}"

            lines.append(
                f"| {v} | {d} | {len(members)} | {1000 * step:.1f} | {ratio} | "
                f"{per_step('comm_bytes_per_step')} | {per_step('comm_gradients_bytes_per_step')} "
                f"| {per_step('comm_buffers_bytes_per_step')} | "
                f"{per_step('comm_norm_statistics_bytes_per_step')} | "
                f"{per_step('comm_calls_per_step')} |"
            )
        return lines

    def spot_check_section(self) -> list[str]:
        twins = {(r["bn"], r["devices"], r["seed"]): r for r in self.runs}
        pairs = [
            (r, twins[(r["bn"], r["devices"], r["seed"])])
            for r in sorted(self.ddp, key=lambda r: (r["bn"], r["devices"], r["seed"]))
            if (r["bn"], r["devices"], r["seed"]) in twins
        ]
        if not pairs:
            return []
        err, loss = self.floor, self.loss_floor
        lines = [
            "",
            "## Real DDP against the emulation",
            "",
            "Real gloo DDP runs next to their emulated twins (same bn, devices, seed): the same "
            "computation in exact arithmetic, so they may differ by the float32 noise floor "
            "only"
            + (
                f" (one run: {err.std:.2f} pp test error, {loss.std:.4f} final training loss; "
                f"a difference of two runs: {math.sqrt(2) * err.std:.2f} pp, "
                f"{math.sqrt(2) * loss.std:.4f})."
                if err
                else "."
            ),
            "",
            "| bn | devices | seed | test error DDP | emulated | Δ (pp) | Δ / noise | "
            "train loss DDP | emulated | Δ | Δ / noise | Δ loss at first logged step (rel.) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r, twin in pairs:
            d_err = r.test_error - twin.test_error
            d_loss = r["train_loss"] - twin["train_loss"]
            e_ratio = _ratio(d_err, math.sqrt(2) * err.std) if err else "–"
            l_ratio = _ratio(d_loss, math.sqrt(2) * loss.std) if loss else "–"
            lines.append(
                f"| {r['bn']} | {r['devices']} | {r['seed']} | {r.test_error:.2f} | "
                f"{twin.test_error:.2f} | {d_err:+.2f} | {e_ratio} | {r['train_loss']:.4f} | "
                f"{twin['train_loss']:.4f} | {d_loss:+.4f} | {l_ratio} | "
                f"{_first_loss_gap(r, twin)} |"
            )
        return lines

    def anchors_section(self) -> list[str]:
        bn = {b: mean_std(self.seeds("bn", b).values())[0] for b in self.batches}
        here_bn = ", ".join(
            f"{bn[b]:.1f}" for b in GN_PAPER_BN_ERROR if b in bn and not math.isnan(bn[b])
        )
        shown = "/".join(str(b) for b in GN_PAPER_BN_ERROR if b in bn)
        deltas = self.against_largest("bn")
        best = min(deltas, key=lambda b: deltas[b].mean) if deltas else None
        gn_err = mean_std([r.test_error for r in self.gn])[0]
        sync_err = mean_std([r.test_error for r in self.runs if r["bn"] == "sync"])[0]
        brn4 = [r for r in self.recovery_rows if r["variant"] == "brn (EMA)" and r["batch"] == 4]
        lines = [
            "",
            "## Anchors",
            "",
            "| source | their setting | what they report | what this study shows |",
            "|---|---|---|---|",
            "| Wu & He 2018, Table 3 | ResNet-50, ImageNet, per-GPU BN | BN error "
            + " / ".join(f"{e}" for e in GN_PAPER_BN_ERROR.values())
            + f" % at {'/'.join(map(str, GN_PAPER_BN_ERROR))} images per GPU "
            f"(+{GN_PAPER_BN_ERROR[2] - GN_PAPER_BN_ERROR[32]:.1f} pp from 32 to 2); GN flat at "
            f"about {GN_PAPER_GN_ERROR} % | bn error {here_bn} % at {shown} images per device"
            + (
                f" ({bn[2] - bn[32]:+.1f} pp from 32 to 2)"
                if 2 in bn and 32 in bn and not math.isnan(bn[2] - bn[32])
                else ""
            )
            + (f"; gn {gn_err:.1f} % against sync {sync_err:.1f} %" if self.gn else "")
            + " |",
        ]
        if best is not None:
            d = deltas[best]
            lines.append(
                "| Kosson et al. 2024, Ghost Noise | ResNet-18, CIFAR-100, total batch 256 | "
                "the best ghost batch (16) is just over 1 pp better than full-batch BN | "
                "per-device BN is ghost BN with the per-device batch as the ghost batch: the "
                f"best here is {best} images per device, {fmt_paired(d)} pp against "
                f"{self.largest} (p = {fmt_p(d.p)}, n = {d.n}) |"
            )
        if brn4:
            row = brn4[0]
            rec = row["recovered"]
            lines.append(
                "| Ioffe 2017, Batch Renormalization | Inception-v3, ImageNet, microbatches of 4 | "
                "BN 74.2 % and Batch Renorm 76.5 % top-1 against 78.3 % with 32 per microbatch: "
                "about half of the loss recovered | at 4 images per device: BN's loss "
                f"{fmt_paired(row['bn_loss'])} pp, brn's remaining {fmt_paired(row['vs_sync'])} pp"
                + ("" if math.isnan(rec) else f" ({100 * rec:.0f} % recovered)")
                + " |"
            )
        return lines

    # -- the reading ---------------------------------------------------------------
    def reading(self) -> list[str]:
        lines = []
        if self.floor is not None and not math.isnan(self.floor.p):
            f = self.floor
            lines.append(
                f"- **SyncBN is flat across device counts** — {verdict(f.flat)}: "
                f"its mean test error ranges over {f.spread:.2f} pp across {f.device_counts} "
                f"device counts; the device count explains no more than the noise floor "
                f"({f.std:.2f} pp per run) predicts (two-way ANOVA, seeds as blocks: "
                f"F = {f.f:.2f}, p = {fmt_p(f.p)}, {f.seeds} seeds)."
            )
        deltas = self.against_largest("bn")
        if deltas:
            threshold = stats.significant_from(deltas)
            series = ", ".join(
                f"{d.mean:+.2f} ± {d.std:.2f} at {b}"
                for b, d in sorted(deltas.items(), reverse=True)
            )
            smallest = min(deltas)
            if threshold is None:
                lines.append(
                    f"- **Per-device BN degrades as the per-device batch shrinks** — does not "
                    f"hold: not even at {smallest} image(s) per device is it significantly worse "
                    f"than at {self.largest} (Δ pp by images per device: {series})."
                )
            else:
                d = deltas[threshold]
                lines.append(
                    f"- **Per-device BN degrades as the per-device batch shrinks** — holds: "
                    f"significantly worse than at {self.largest} images per device (paired "
                    f"t-test, p < {stats.ALPHA}) from **{threshold} images per device** down "
                    f"({d.mean:+.2f} ± {d.std:.2f} pp there, p = {fmt_p(d.p)}); Δ pp by images "
                    f"per device: {series}."
                )
        lines += self.recovery_reading()
        lines += self.convergence_reading()
        lines += self.normalization_reading()
        return lines

    def normalization_reading(self) -> list[str]:
        """SyncBN on several devices normalises over the global batch, as bn on one device
        does: against the normalisation batch their points fall on one x, and should agree."""
        several = [r for r in self.runs if r["bn"] == "sync" and r["devices"] > 1]
        if not several or not self.base:
            return []
        per_seed: dict[int, list[float]] = defaultdict(list)
        for r in several:
            per_seed[r["seed"]].append(r.test_error)
        sync = {s: sum(v) / len(v) for s, v in per_seed.items()}
        d = paired(sync, self.base)
        batch = several[0]["normalization_batch_size"]
        return [
            f"- **Test error follows the normalisation batch** "
            f"(`test_error_vs_normalization_batch.png`: bn and brn move to their per-device "
            f"batch, SyncBN's device counts fall on {batch}) — {verdict(not d.significant)}: "
            f"at {batch} images per normalisation batch, SyncBN on 2 or more devices (mean per "
            f"seed) differs from bn on one device by {fmt_paired(d)} pp (p = {fmt_p(d.p)}, "
            f"n = {d.n})."
        ]

    def recovery_reading(self) -> list[str]:
        rows = self.recovery_rows
        lines = []
        for name, label in (
            ("brn (EMA)", "Batch Renormalization"),
            ("bn (PreciseBN)", "PreciseBN"),
            ("gn", "GroupNorm"),
        ):
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

    def convergence_reading(self) -> list[str]:
        lines = []
        loss = {
            b: mean_std(self.seeds("bn", b, train_loss).values())[0]
            for b in self.batches
            if self.cells.get(("bn", b))
        }
        if len(loss) > 1:
            ordered = [loss[b] for b in sorted(loss, reverse=True)]
            rising = all(a < b for a, b in zip(ordered, ordered[1:], strict=False))
            lines.append(
                f"- **Per-device BN's final training loss rises at every halving of the "
                f"per-device batch** — {verdict(rising)}: "
                + ", ".join(f"{loss[b]:.4f} at {b}" for b in sorted(loss, reverse=True))
                + (
                    f" (noise floor of one run: {self.loss_floor.std:.4f})."
                    if self.loss_floor
                    else "."
                )
            )
        if self.loss_floor is not None and not math.isnan(self.loss_floor.p):
            f = self.loss_floor
            lines.append(
                f"- **SyncBN's final training loss is flat across device counts** — "
                f"{verdict(f.flat)}: range {f.spread:.4f} (F = {f.f:.2f}, "
                f"p = {fmt_p(f.p)}); the curves per device count are in `train_loss_curves.png`."
            )
        return lines


def _missing_note(failed: list[Failure], some_finished: bool) -> str:
    """How a cell marks its runs without a result: diverged runs are named as such (they
    are a result about the setting, not a gap), the others as missing."""
    diverged = sum(f.diverged for f in failed)
    parts = [
        f"{n} {what}"
        for n, what in ((diverged, "diverged"), (len(failed) - diverged, "missing"))
        if n
    ]
    if not parts:
        return ""
    if some_finished or len(parts) > 1:
        return f" ({', '.join(parts)})"
    return " " + parts[0].split(" ", 1)[1]


def _missing_section(failures: list[Failure]) -> list[str]:
    """The failed runs, one line each: which cell, and why (their error.json)."""
    lines = [
        "",
        f"**{len(failures)} run(s) failed** and are missing from the tables below:",
        "",
        "| bn | parallel | devices | images per device | seed | reason | run dir |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in sorted(failures, key=lambda f: str(f.run_dir)):
        per_device = f["per_device_batch_size"]
        if isinstance(per_device, float):
            per_device = f"{per_device:g}"
        reason = f.reason.replace("|", "\\|")
        lines.append(
            f"| {f['bn']} | {f['parallel']} | {f['devices']} | {per_device} | {f['seed']} | "
            f"{reason} | {f.run_dir.name} |"
        )
    return lines


def _ratio(value: float, noise: float) -> str:
    return f"{value / noise:+.1f}" if noise > 0 else "–"


def _first_loss_gap(run: Run, twin: Run) -> str:
    """Relative gap of the first logged training loss, before float32 rounding differences
    (the two modes sum in different orders) have had many steps to grow."""
    a, b = dict(run.loss_curve), dict(twin.loss_curve)
    common = sorted(set(a) & set(b))
    if not common:
        return "–"
    step = common[0]
    return f"{abs(a[step] - b[step]) / max(abs(b[step]), 1e-12):.1e}"
