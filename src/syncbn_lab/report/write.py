"""Write results.csv, README.md (tables, paired comparisons, a reading) and PNG plots."""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from pathlib import Path

from syncbn_lab.errors import UserError
from syncbn_lab.report.collect import CSV_COLUMNS, Failure, Run

# Wu & He, "Group Normalization" (ECCV 2018), Table 3: ResNet-50 on ImageNet, BN computed
# per GPU, validation error (%) by images per GPU.
GN_PAPER_BN_ERROR = {32: 23.6, 16: 23.7, 8: 24.8, 4: 27.3, 2: 34.7}
VARIANT_ORDER = ("bn", "brn", "sync", "torch_sync", "gn")


X_AXES = {
    "per_device_batch_size": "images per device (global batch fixed)",
    "normalization_batch_size": "images per normalisation batch (global batch fixed)",
}
"""What the test-error plot can use as its x axis (``--x``): a summary.json key -> its label."""


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(mean: float, std: float, digits: int = 2) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def group(runs: list[Run], *keys: str) -> dict[tuple, list[Run]]:
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        groups[tuple(run[k] for k in keys)].append(run)
    return groups


def paired_vs_one_device(runs: list[Run], variant: str) -> list[dict]:
    """For each device count, the per-seed difference in test error against devices=1."""
    from scipy import stats

    by_devices = group([r for r in runs if r["bn"] == variant], "devices")
    base = {r["seed"]: r.test_error for r in by_devices.get((1,), [])}
    rows = []
    for (devices,), members in sorted(by_devices.items()):
        if devices == 1:
            continue
        pairs = [(r.test_error, base[r["seed"]]) for r in members if r["seed"] in base]
        if not pairs:
            continue
        diffs = [a - b for a, b in pairs]
        p = math.nan
        if len(pairs) > 1 and statistics.pstdev(diffs) > 0:
            p = float(stats.ttest_rel([a for a, _ in pairs], [b for _, b in pairs]).pvalue)
        rows.append(
            {
                "devices": devices,
                "per_device": members[0]["per_device_batch_size"],
                "n": len(pairs),
                "diff": statistics.fmean(diffs),
                "p": p,
            }
        )
    return rows


def write_report(
    runs: list[Run],
    out_dir: Path,
    title: str,
    sweep_wall_time_s: float | None = None,
    failures: list[Failure] = (),
    *,
    x_axis: str = "per_device_batch_size",
) -> None:
    """results.csv, README.md and the plots of ``runs`` into ``out_dir``; the cells of
    ``failures`` are marked missing, with each failed run's one-line reason."""
    _check_x_axis(runs, x_axis)  # before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    emulated_or_single = [r for r in runs if r["parallel"] != "ddp"]
    ddp = [r for r in runs if r["parallel"] == "ddp"]
    main = emulated_or_single or runs
    _write_csv(runs, out_dir / "results.csv")
    plots = _plots(main, out_dir, x_axis)
    text = _markdown(main, ddp, title, plots, sweep_wall_time_s, list(failures))
    if (out_dir / NOTES).exists():
        text += f"\nMore observations on this run, written by hand: [{NOTES}]({NOTES}).\n"
    (out_dir / "README.md").write_text(text)


def _check_x_axis(runs: list[Run], x_axis: str) -> None:
    if x_axis not in X_AXES:
        raise UserError(f"unknown x axis {x_axis!r}; choose one of {', '.join(X_AXES)}")
    lacking = [r for r in runs if not isinstance(r[x_axis], int)]
    if lacking:
        raise UserError(
            f"{len(lacking)} run(s) have no {x_axis} in summary.json (e.g. "
            f"{lacking[0].run_dir}); rerun them, or plot against --x per_device_batch_size"
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


def _markdown(runs, ddp, title, plots, sweep_wall_time_s, failures) -> str:
    variants = _variants(runs)
    failed_cells = group(failures, "bn", "per_device_batch_size")
    batches = {r["per_device_batch_size"] for r in runs if r["bn"] != "gn"}
    batches |= {f["per_device_batch_size"] for f in failures if f["bn"] in variants}
    batches = sorted((b for b in batches if isinstance(b, int)), reverse=True)
    cells = group(runs, "bn", "per_device_batch_size")
    any_run = runs[0]
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        f"# {title}",
        "",
        f"{any_run['model']} on {any_run['dataset']}, global batch "
        f"{any_run['global_batch_size']}, {len(seeds)} seed(s) ({', '.join(map(str, seeds))}), "
        f"{len(runs)} runs, parallel mode(s): "
        f"{', '.join(sorted({r['parallel'] for r in runs}))}.",
    ]
    if sweep_wall_time_s is not None:
        lines.append(f"The sweep took {sweep_wall_time_s / 60:.1f} minutes of wall time.")
    if failures:
        lines += _missing_section(failures)
    lines += ["", "## Test error (%), mean ± std over seeds", ""]
    header = "| images per device | " + " | ".join(
        f"{v} (EMA) | {v} (PreciseBN)" for v in variants if v != "gn"
    )
    lines += [header + " |", "|" + "---|" * (1 + 2 * len([v for v in variants if v != "gn"]))]
    for b in batches:
        row = [str(b)]
        for v in variants:
            if v == "gn":
                continue
            members = cells.get((v, b), [])
            note = _missing_note(len(failed_cells.get((v, b), [])), bool(members))
            row.append(fmt(*mean_std([r.test_error for r in members])) + note)
            row.append(fmt(*mean_std([r.test_error_precise_bn for r in members])) + note)
        lines.append("| " + " | ".join(row) + " |")
    gn_runs = [r for r in runs if r["bn"] == "gn"]
    if gn_runs:
        lines += [
            "",
            f"GroupNorm (batch-independent reference): "
            f"{fmt(*mean_std([r.test_error for r in gn_runs]))} % test error.",
        ]
    lines += ["", "## Final training loss (mean over the last epoch), mean ± std", ""]
    lines += [
        "| images per device | " + " | ".join(variants) + " |",
        "|" + "---|" * (1 + len(variants)),
    ]
    for b in batches:
        row = [str(b)]
        for v in variants:
            members = cells.get((v, b), [])
            row.append(fmt(*mean_std([r["train_loss"] for r in members]), digits=4))
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "## Paired comparison against 1 device (same seed)",
        "",
        "Difference in test error (percentage points) of each device count against "
        "devices = 1 with the same seed; p from a paired t-test over seeds.",
        "",
        "| bn | devices | images per device | seeds | Δ error (pp) | p |",
        "|---|---|---|---|---|---|",
    ]
    for v in variants:
        for row in paired_vs_one_device(runs, v):
            p = "–" if math.isnan(row["p"]) else f"{row['p']:.3g}"
            lines.append(
                f"| {v} | {row['devices']} | {row['per_device']} | {row['n']} | "
                f"{row['diff']:+.2f} | {p} |"
            )
    if ddp:
        lines += _ddp_section(runs, ddp)
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    lines += ["", "## Reading", ""] + _reading(runs, cells, batches)
    return "\n".join(lines) + "\n"


def _missing_note(failed: int, some_finished: bool) -> str:
    if not failed:
        return ""
    return f" ({failed} missing)" if some_finished else " missing"


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


NOTES = "NOTES.md"
"""Hand-written observations kept next to a report (not regenerated); linked when present."""


def _ddp_section(emulated: list[Run], ddp: list[Run]) -> list[str]:
    twins = {(r["bn"], r["devices"], r["seed"]): r for r in emulated}
    lines = [
        "",
        "## Real DDP against the emulation",
        "",
        "Real gloo DDP runs next to their emulated twins (same bn, devices, seed).",
        "",
        "| bn | devices | seed | test acc DDP | test acc emulated | Δ acc | "
        "train loss DDP | train loss emulated | Δ loss (rel.) | "
        f"Δ loss at step {_first_step(ddp)} (rel.) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(ddp, key=lambda r: (r["bn"], r["devices"], r["seed"])):
        twin = twins.get((r["bn"], r["devices"], r["seed"]))
        if twin is None:
            continue
        rel = abs(r["train_loss"] - twin["train_loss"]) / max(abs(twin["train_loss"]), 1e-12)
        lines.append(
            f"| {r['bn']} | {r['devices']} | {r['seed']} | {r['test_acc']:.2f} | "
            f"{twin['test_acc']:.2f} | {r['test_acc'] - twin['test_acc']:+.2f} | "
            f"{r['train_loss']:.6f} | {twin['train_loss']:.6f} | {rel:.1e} | "
            f"{_first_loss_gap(r, twin)} |"
        )
    return lines


def _first_step(runs: list[Run]) -> int | str:
    steps = [r.loss_curve[0][0] for r in runs if r.loss_curve]
    return min(steps) if steps else "–"


def _first_loss_gap(run: Run, twin: Run) -> str:
    """Relative gap of the first logged training loss, before float32 rounding differences
    (the two modes sum in different orders) have had many steps to grow."""
    a, b = dict(run.loss_curve), dict(twin.loss_curve)
    common = sorted(set(a) & set(b))
    if not common:
        return "–"
    step = common[0]
    return f"{abs(a[step] - b[step]) / max(abs(b[step]), 1e-12):.1e}"


def _reading(runs, cells, batches) -> list[str]:
    lines = []
    sync = [r for r in runs if r["bn"] == "sync"]
    if sync:
        by_dev = group(sync, "devices")
        means = [mean_std([r.test_error for r in m])[0] for m in by_dev.values()]
        seed_ranges = [
            max(r.test_error for r in m) - min(r.test_error for r in m) for m in by_dev.values()
        ]
        spread, seed_spread = max(means) - min(means), statistics.fmean(seed_ranges)
        verdict = "holds" if spread <= seed_spread + 1e-9 else "does not hold"
        lines.append(
            f"- **SyncBN does not depend on the device count** — {verdict} here: its mean test "
            f"error ranges over {spread:.2f} pp across device counts, against a mean range "
            f"of {seed_spread:.2f} pp across seeds at one device count."
        )
    bn_means = {b: mean_std([r.test_error for r in cells.get(("bn", b), [])])[0] for b in batches}
    bn_means = {b: m for b, m in bn_means.items() if not math.isnan(m)}
    if bn_means:
        largest, smallest = max(bn_means), min(bn_means)
        series = ", ".join(f"{bn_means[b]:.2f} % at {b}" for b in sorted(bn_means, reverse=True))
        lines.append(f"- **Per-device BN** test error by images per device: {series}.")
        loss = {
            b: mean_std([r["train_loss"] for r in cells.get(("bn", b), [])])[0] for b in bn_means
        }
        ordered = [loss[b] for b in sorted(loss, reverse=True)]
        monotone = all(a <= b for a, b in zip(ordered, ordered[1:], strict=False))
        lines.append(
            f"  Final training loss goes from {loss[largest]:.4f} at {largest} to "
            f"{loss[smallest]:.4f} at {smallest} image(s) per device"
            + (
                ", rising at every halving: BN converges more slowly as the per-device batch "
                "shrinks."
                if monotone
                else "."
            )
        )
        above_one = [bn_means[b] for b in bn_means if b > 1]
        if 1 in bn_means and len(above_one) > 1:
            lines.append(
                f"  Test error at 2 or more images per device stays within "
                f"{max(above_one) - min(above_one):.2f} pp ({min(above_one):.2f}-"
                f"{max(above_one):.2f} %); at 1 image per device it is {bn_means[1]:.2f} %."
            )
        precise = {
            b: mean_std([r.test_error_precise_bn for r in cells.get(("bn", b), [])])[0]
            for b in bn_means
        }
        if not math.isnan(precise.get(smallest, math.nan)):
            lines.append(
                f"- **PreciseBN** at {smallest} image(s) per device: {precise[smallest]:.2f} % "
                f"against {bn_means[smallest]:.2f} % with the EMA statistics."
            )
    paper = ", ".join(f"{e} % at {b}" for b, e in GN_PAPER_BN_ERROR.items())
    lines.append(
        f"- For scale: Wu & He (Group Normalization, 2018, Table 3) report ResNet-50 ImageNet "
        f"validation error with per-GPU BN of {paper} images per GPU, while GroupNorm stays "
        "flat. MNIST is far easier, so the absolute numbers differ; the shape to compare is "
        "flat for SyncBN and GroupNorm, rising for BN as the per-device batch shrinks."
    )
    return lines


def _plots(runs: list[Run], out_dir: Path, x_axis: str = "per_device_batch_size") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for v in _variants(runs):
        members = [r for r in runs if r["bn"] == v]
        if v == "gn":
            m, s = mean_std([r.test_error for r in members])
            ax.axhline(m, color="grey", linestyle=":", label=f"gn (±{s:.2f})")
            continue
        cells = group(members, x_axis)
        xs = sorted(b for (b,) in cells)
        for attr, style in (("test_error", "-o"), ("test_error_precise_bn", "--s")):
            stats_ = [mean_std([getattr(r, attr) for r in cells[(b,)]]) for b in xs]
            if all(math.isnan(m) for m, _ in stats_):
                continue
            label = f"{v} ({'EMA' if attr == 'test_error' else 'PreciseBN'})"
            # the lower bar is clipped so a log axis never sees an error <= 0
            lower = [max(0.0, min(s, 0.9 * m)) for m, s in stats_]
            ax.errorbar(
                xs,
                [m for m, _ in stats_],
                yerr=[lower, [s for _, s in stats_]],
                fmt=style,
                capsize=3,
                label=label,
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_xlabel(X_AXES[x_axis])
    ax.set_ylabel("test error (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = f"test_error_vs_{x_axis.removesuffix('_size')}.png"
    fig.savefig(out_dir / name, dpi=120)
    plt.close(fig)
    names.append(name)

    variants = [v for v in ("bn", "sync") if any(r["bn"] == v for r in runs)]
    if variants and any(r.loss_curve for r in runs):
        fig, axes = plt.subplots(1, len(variants), figsize=(6 * len(variants), 4), sharey=True)
        axes = [axes] if len(variants) == 1 else list(axes)
        for ax, v in zip(axes, variants, strict=True):
            by_dev = group([r for r in runs if r["bn"] == v], "devices")
            for (devices,), members in sorted(by_dev.items()):
                curves = [dict(r.loss_curve) for r in members if r.loss_curve]
                steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
                if steps:
                    ax.plot(
                        steps,
                        [statistics.fmean(c[s] for c in curves) for s in steps],
                        label=f"{devices} dev ({members[0]['per_device_batch_size']}/dev)",
                    )
            ax.set_title(f"bn={v}")
            ax.set_xlabel("optimizer step")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("training loss (mean over seeds)")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "train_loss_curves.png", dpi=120)
        plt.close(fig)
        names.append("train_loss_curves.png")
    return names
