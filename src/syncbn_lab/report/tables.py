"""The report's markdown tables, each a list of lines from a :class:`~.study.Study`."""

from __future__ import annotations

import math

from syncbn_lab.report.collect import Failure, Run
from syncbn_lab.report.papers import mark, papers
from syncbn_lab.report.stats import difference_noise, mean_std
from syncbn_lab.report.study import SMALL_BATCH, Study, group, per_sample
from syncbn_lab.report.text import fmt, fmt_p, fmt_paired, table_head, table_row
from syncbn_lab.variants import GROUP, VARIANTS


def error_table(study: Study) -> list[str]:
    shown = [v for v in study.variants if not per_sample(v)]
    lines = ["", "## Test error (%), mean ± std over seeds", ""]
    lines += table_head(
        "images per device", *(f"{v} ({stats})" for v in shown for stats in ("EMA", "PreciseBN"))
    )
    for b in study.batches:
        row = [str(b)]
        for v in shown:
            members = study.cells.get((v, b), [])
            note = missing_note(study.failed_cells.get((v, b), []), bool(members))
            row.append(fmt(*mean_std([r.test_error for r in members])) + note)
            row.append(fmt(*mean_std([r.test_error_precise_bn for r in members])) + note)
        lines.append(table_row(*row))
    counts = sorted({len(m) for (v, _), m in study.cells.items() if not per_sample(v)})
    lines += ["", f"Seeds per cell: {', '.join(map(str, counts))}."]
    for v in study.sample_remedies:
        members = [r for r in study.per_sample_runs if r[GROUP] == v.name]
        if members:
            lines.append(
                f"{v.label} (batch-independent, run once per seed): "
                f"{fmt(*mean_std([r.test_error for r in members]))} % test error "
                f"(n = {len(members)})."
            )
    return lines


def noise_section(study: Study) -> list[str]:
    if study.floor is None:
        return []
    f, loss = study.floor, study.loss_floor
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
        f"of √2 × that: {difference_noise(f.std):.2f} pp.",
    ]


def paired_section(study: Study) -> list[str]:
    lines = [
        "",
        f"## Against per-device BN at {study.largest} images per device (same seed)",
        "",
        "Δ = test error minus that of the bn run at the largest per-device batch with the "
        "same seed (mean ± std over seeds, percentage points); p from a paired t-test; "
        "the last column sets Δ against the noise of a difference of two runs.",
        "",
        *table_head(
            "variant",
            "images per device",
            "normalisation batch",
            "n",
            "Δ error (pp)",
            "p",
            "Δ / noise",
        ),
    ]
    noise = difference_noise(study.floor.std) if study.floor else 0.0
    for v in study.variants:
        for b, d in study.against_largest(v).items():
            norm = study.cells[(v, b)][0]["normalization_batch_size"]
            ratio = f"{d.mean / noise:+.1f}" if noise > 0 else "–"
            lines.append(table_row(v, b, norm, d.n, fmt_paired(d), fmt_p(d.p), ratio))
    return lines


def recovery_section(study: Study) -> list[str]:
    """BN's loss at small per-device batches and what each remedy recovers of it."""
    rows = study.recovery_rows
    if not rows:
        return []
    lines = [
        "",
        f"## Recovering BN's loss at {SMALL_BATCH} or fewer images per device",
        "",
        "BN's loss = bn's test error minus SyncBN's of the same seed (its mean over device "
        "counts: one model at every count). Each "
        "remedy is compared, seed by seed, with SyncBN (its remaining loss) and with bn "
        "(what it wins); recovered = 1 − remaining / BN's loss.",
        "",
        *table_head(
            "images per device",
            "BN's loss (pp)",
            "p",
            "remedy",
            "error (%)",
            "remaining vs sync (pp)",
            "p",
            "vs bn (pp)",
            "p",
            "recovered",
        ),
    ]
    return lines + [_recovery_row(row) for row in rows]


def _recovery_row(row: dict) -> str:
    """One row of the recovery table (``Study.recovery_rows``' dict)."""
    rec = "–" if math.isnan(row["recovered"]) else f"{100 * row['recovered']:.0f} %"
    return table_row(
        row["batch"], fmt_paired(row["bn_loss"]), fmt_p(row["bn_loss"].p), row["variant"],
        fmt(*row["error"]), fmt_paired(row["vs_sync"]), fmt_p(row["vs_sync"].p),
        fmt_paired(row["vs_bn"]), fmt_p(row["vs_bn"].p), rec,
    )  # fmt: skip


def loss_table(study: Study) -> list[str]:
    lines = ["", "## Final training loss (mean over the last epoch), mean ± std", ""]
    lines += table_head("images per device", *study.variants)
    for b in study.batches:
        row = [str(b)]
        for v in study.variants:
            members = study.cells.get((v, b), [])
            row.append(fmt(*mean_std([r["train_loss"] for r in members]), digits=4))
        lines.append(table_row(*row))
    return lines


def cost_section(study: Study) -> list[str]:
    """Step time and bytes per step under real DDP, per variant and rank count."""
    cells = group(study.ddp, GROUP, "devices")
    reference = {
        d: mean_std([r["step_time_s"] for r in m])[0]
        for (v, d), m in cells.items()
        if v == study.baseline
    }
    lines = [
        "",
        f"## Cost under real DDP{_machine(study.ddp)}",
        "",
        "Step time: training time over optimizer steps of rank 0 (data loading included; "
        "1 thread per rank). Bytes: what each rank hands to collectives per step, counted "
        "at the calls (syncbn_lab.traffic): gradient buckets, DDP's broadcast of rank 0's "
        "buffers, SyncBN's statistics. A ring all-reduce puts about 2 (N − 1) / N of its "
        "payload on the wire per rank.",
        "",
        *table_head(
            "bn",
            "ranks",
            "runs",
            "step time (ms)",
            "× bn",
            "bytes per step",
            "gradients",
            "buffers",
            "norm statistics",
            "collectives per step",
        ),
    ]
    order = {v: i for i, v in enumerate(VARIANTS)}
    for (v, d), members in sorted(cells.items(), key=lambda c: (c[0][1], order.get(c[0][0], 9))):
        step = mean_std([r["step_time_s"] for r in members])[0]
        ratio = f"{step / reference[d]:.2f}" if reference.get(d) and not math.isnan(step) else "–"
        time = "–" if math.isnan(step) else f"{1000 * step:.1f}"

        counts = [_per_step(members, f"comm_{kind}per_step") for kind in _COMM_COLUMNS]
        lines.append(table_row(v, d, len(members), time, ratio, *counts))
    return lines


_COMM_COLUMNS = ("bytes_", "gradients_bytes_", "buffers_bytes_", "norm_statistics_bytes_", "calls_")
"""The cost table's columns after the ratio: summary.json's comm_<kind>per_step."""


def _per_step(members: list[Run], key: str) -> str:
    """The mean of a per-step count over ``members``, with thousands separators."""
    value = mean_std([r[key] for r in members])[0]
    return "–" if math.isnan(value) else f"{value:,.0f}"


def spot_check_section(study: Study) -> list[str]:
    """Each real DDP run against its emulated twin (same cell, same steps: a short cost run
    has none), beside the float32 noise floor."""

    def cell(r: Run) -> tuple:
        return r[GROUP], r["devices"], r["seed"]

    twins = {cell(r): r for r in study.runs}
    pairs = [(r, twins[cell(r)]) for r in sorted(study.ddp, key=cell)
             if cell(r) in twins and twins[cell(r)]["steps"] == r["steps"]]  # fmt: skip
    if not pairs:
        return []
    err, loss = study.floor, study.loss_floor
    lines = [
        "",
        "## Real DDP against the emulation",
        "",
        "Real gloo DDP runs next to their emulated twins (same bn, devices, seed): the same "
        "computation in exact arithmetic, so they may differ by the float32 noise floor "
        "only"
        + (
            f" (one run: {err.std:.2f} pp test error, {loss.std:.4f} final training loss; "
            f"a difference of two runs: {difference_noise(err.std):.2f} pp, "
            f"{difference_noise(loss.std):.4f})."
            if err
            else "."
        ),
        "",
        *table_head(  # one string: the columns are prose, not a parallel mode's name
            *(
                "bn | devices | seed | test error DDP | emulated | Δ (pp) | Δ / noise | "
                "train loss DDP | emulated | Δ | Δ / noise | Δ loss at first logged step (rel.)"
            ).split(" | ")
        ),
    ]
    for r, twin in pairs:
        d_err = r.test_error - twin.test_error
        d_loss = r["train_loss"] - twin["train_loss"]
        e_ratio = _ratio(d_err, difference_noise(err.std)) if err else "–"
        l_ratio = _ratio(d_loss, difference_noise(loss.std)) if loss else "–"
        errors = (f"{r.test_error:.2f}", f"{twin.test_error:.2f}", f"{d_err:+.2f}", e_ratio)
        losses = (f"{r['train_loss']:.4f}", f"{twin['train_loss']:.4f}", f"{d_loss:+.4f}")
        gap = _first_loss_gap(r, twin)
        lines.append(table_row(r[GROUP], r["devices"], r["seed"], *errors, *losses, l_ratio, gap))
    return lines


def anchors_section(study: Study) -> list[str]:
    """The study's figures next to the papers' (syncbn_lab/report/papers.yaml)."""
    cited = papers()
    gn_paper, ghost, renorm = cited["group_norm"], cited["ghost_noise"], cited["batch_renorm"]
    paper_bn = gn_paper["bn_error_by_images_per_gpu"]
    base, ref = study.baseline, study.reference
    bn = {b: mean_std(study.seeds(base, b).values())[0] for b in study.batches}
    here_bn = ", ".join(f"{bn[b]:.1f}" for b in paper_bn if b in bn and not math.isnan(bn[b]))
    shown = "/".join(str(b) for b in paper_bn if b in bn)
    deltas = study.against_largest(base)
    best = min(deltas, key=lambda b: deltas[b].mean) if deltas else None
    sample = [f"{v.name} {mean_std([r.test_error for r in study.per_sample_runs])[0]:.1f} %"
              for v in study.sample_remedies]  # fmt: skip
    sync_err = mean_std([r.test_error for r in study.runs if r[GROUP] == ref])[0]
    renorm_cell = (f"{renorm['variant']} (EMA)", renorm["images_per_device"])
    renorm_rows = [r for r in study.recovery_rows if (r["variant"], r["batch"]) == renorm_cell]
    small, large = min(paper_bn), max(paper_bn)
    lines = [
        "",
        "## Anchors",
        "",
        *table_head("source", "their setting", "what they report", "what this study shows"),
        f"| {gn_paper['source']} | {gn_paper['setting']} | BN error "
        + " / ".join(f"{e}" for e in paper_bn.values())
        + f" % at {'/'.join(map(str, paper_bn))} images per GPU "
        f"(+{paper_bn[small] - paper_bn[large]:.1f} pp from {large} to {small}); GN flat at "
        f"about {gn_paper['gn_error']} % | {base} error {here_bn} % at {shown} images per device"
        + (
            f" ({bn[small] - bn[large]:+.1f} pp from {large} to {small})"
            if small in bn and large in bn and not math.isnan(bn[small] - bn[large])
            else ""
        )
        + (f"; {sample[0]} against {ref} {sync_err:.1f} %" if study.per_sample_runs else "")
        + " |",
    ]
    if best is not None:
        d = deltas[best]
        lines.append(
            f"| {ghost['source']} | {ghost['setting']} | {ghost['finding']} | "
            f"per-device BN is ghost BN with the per-device batch as the ghost batch: the "
            f"best here is {best} images per device, {fmt_paired(d)} pp against "
            f"{study.largest} (p = {fmt_p(d.p)}, n = {d.n}) |"
        )
    if renorm_rows:
        row = renorm_rows[0]
        rec = row["recovered"]
        lines.append(
            f"| {renorm['source']} | {renorm['setting']} | {renorm['finding']} | "
            f"at {row['batch']} images per device: BN's loss "
            f"{fmt_paired(row['bn_loss'])} pp, {renorm['variant']}'s remaining "
            f"{fmt_paired(row['vs_sync'])} pp"
            + ("" if math.isnan(rec) else f" ({100 * rec:.0f} % recovered)")
            + " |"
        )
    lines += _remedy_anchor(study, cited["group_norm_remedies"])
    lines += _batch_anchor(study, cited["rethinking_batch"])
    return lines


def _remedy_anchor(study: Study, paper: dict) -> list[str]:
    """Wu & He's remedies at their small per-GPU batch beside the same variants here."""
    b = paper["images_per_device"]
    here = []
    for name in paper["errors"]:
        members = study.cells.get((name, b)) or [r for r in study.per_sample_runs
                                                  if r[GROUP] == name]  # fmt: skip
        if members:
            here.append(f"{name} {mean_std([r.test_error for r in members])[0]:.2f} %")
    if not here:
        return []
    theirs = ", ".join(f"{k} {v} %" for k, v in paper["errors"].items())
    return [
        f"| {paper['source']}{mark(paper)} | {paper['setting']} | error {theirs} | "
        f"at {b} images per device: {', '.join(here)} |"
    ]


def _batch_anchor(study: Study, paper: dict) -> list[str]:
    """Wu & Johnson's best normalisation batch and PreciseBN's sample count, beside the
    best per-device batch here and PreciseBN's change at the largest."""
    deltas = study.against_largest(study.baseline)
    cell = study.cells.get((study.baseline, study.largest), [])
    if not deltas or not cell:
        return []
    best = min(deltas, key=lambda b: deltas[b].mean)
    precise = mean_std([r.test_error_precise_bn - r.test_error for r in cell])[0]
    return [
        f"| {paper['source']}{mark(paper)} | {paper['setting']} | {paper['finding']} | "
        f"lowest mean error at {best} images per device ({fmt_paired(deltas[best])} pp against "
        f"{study.largest}); PreciseBN minus EMA at {study.largest}: {precise:+.2f} pp |"
    ]


def _machine(runs: list[Run]) -> str:
    """Where the runs ran, as their summary.json records it (backend, device, CPU, cores):
    " (gloo, cpu processes on <CPU>, 2 cores)", or "" for runs that do not record it."""
    facts = [(r["backend"], r["device"], r["cpu_model"], r["cores"]) for r in runs]
    if not facts or len(set(facts)) > 1 or None in facts[0]:
        return ""
    backend, device, cpu, cores = facts[0]
    return f" ({backend}, {device} processes on {cpu}, {cores} cores)"


def missing_note(failed: list[Failure], some_finished: bool) -> str:
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


def missing_section(failures: list[Failure]) -> list[str]:
    """The failed runs, one line each: which cell, and why (their error.json)."""
    lines = [
        "",
        f"**{len(failures)} run(s) failed** and are missing from the tables below:",
        "",
        *table_head("bn", "parallel", "devices", "images per device", "seed", "reason", "run dir"),
    ]
    for f in sorted(failures, key=lambda f: str(f.run_dir)):
        per_device = f["per_device_batch_size"]
        if isinstance(per_device, float):
            per_device = f"{per_device:g}"
        reason = f.reason.replace("|", "\\|")
        lines.append(
            table_row(f[GROUP], f["parallel"], f["devices"], per_device, f["seed"], reason,
                      f.run_dir.name)
        )  # fmt: skip
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
