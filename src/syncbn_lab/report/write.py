"""Write results.csv, README.md (tables, paired tests, the cost table, a reading) and plots.

The figures come from :mod:`~.study`, the tables from :mod:`~.tables`, the reading from
:mod:`~.reading` and the plots from :mod:`~.plots`; this module puts them in one document.
"""

from __future__ import annotations

import csv
from pathlib import Path

from syncbn_lab.errors import UserError
from syncbn_lab.parallel.modes import mode
from syncbn_lab.report import convergence, tables
from syncbn_lab.report.collect import (
    CSV_COLUMNS,
    Failure,
    Run,
    collect_failures,
    collect_runs,
    runs_from_csv,
)
from syncbn_lab.report.plots import write_plots
from syncbn_lab.report.reading import reading
from syncbn_lab.report.study import Study, variant_order
from syncbn_lab.variants import GROUP

NOTES = "NOTES.md"
"""Hand-written observations kept next to a report (not regenerated); linked when present."""


def write_report(
    runs: list[Run],
    out_dir: Path,
    title: str,
    sweep_wall_time_s: float | None = None,
    failures: list[Failure] = (),
    earlier: tuple[str, list[Run]] | None = None,
) -> None:
    """results.csv, README.md and the plots of ``runs`` into ``out_dir``; the cells of
    ``failures`` are marked missing, with each failed run's one-line reason. ``earlier``:
    (name, runs) of a shorter study of the same grid, whose claims are set beside these."""
    _check_normalization_batch(runs)  # before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    one_process = [r for r in runs if not _distributed(r)]
    distributed = [r for r in runs if _distributed(r)]
    main = one_process or runs
    _write_csv(runs, out_dir / "results.csv")
    plots = write_plots(main, out_dir, variant_order(main))
    study = Study(main, distributed if one_process else [], list(failures))
    before = None
    if earlier is not None:
        name, earlier_runs = earlier
        emulated = [r for r in earlier_runs if not _distributed(r)]
        before = (name, Study(emulated, [], []))
    text = markdown(study, title, plots, sweep_wall_time_s, before)
    if (out_dir / NOTES).exists():
        text += (
            f"\nHow the study was designed and more observations, by hand: [{NOTES}]({NOTES}).\n"
        )
    (out_dir / "README.md").write_text(text)


def write_sweep_report(
    sweep_dirs: list[Path],
    out_dir: Path,
    title: str,
    sweep_wall_time_s: float | None = None,
    compare_with: Path | None = None,
) -> tuple[list[Run], list[Failure]]:
    """:func:`write_report` of every run under ``sweep_dirs``, its failed runs marked missing,
    beside the claims of the earlier study whose results.csv is ``compare_with``; returns
    the runs and the failures."""
    runs = collect_runs(*sweep_dirs)
    failures = collect_failures(*sweep_dirs)
    earlier = None
    if compare_with is not None:
        earlier = (compare_with.parent.name, runs_from_csv(compare_with))
    write_report(runs, out_dir, title, sweep_wall_time_s, failures, earlier)
    return runs, failures


def _distributed(run: Run) -> bool:
    """A real multi-process run (DDP), set apart from its emulated twins."""
    return mode(run["parallel"]).distributed


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
        key = lambda r: (r[GROUP], r["parallel"], r["devices"], r["seed"])  # noqa: E731
        for run in sorted(runs, key=key):
            writer.writerow(run.row())


def machines(runs: list[Run]) -> str:
    """The CPUs the runs ran on, with the vector ISA and bf16 support they recorded, and
    how many runs each: what decides their speed and whether bf16 was native."""
    counts: dict[str, int] = {}
    for r in runs:
        if r["cpu_isa"] is None:
            isa = "ISA not recorded"
        else:
            isa = f"{r['cpu_isa']}, bf16 instructions {'yes' if r['cpu_bf16'] else 'no'}"
        name = f"{r['cpu_model'] or 'unknown CPU'} ({isa})"
        counts[name] = counts.get(name, 0) + 1
    return "; ".join(f"{name}: {n} runs" for name, n in counts.items())


def markdown(
    study: Study,
    title: str,
    plots: list[str],
    wall_time_s: float | None,
    earlier: tuple[str, Study] | None = None,
) -> str:
    """The whole README.md of ``study`` (and its claims beside ``earlier``'s)."""
    runs = study.runs + study.ddp
    any_run = study.runs[0]
    seeds = sorted({r["seed"] for r in study.runs})
    commits = sorted({r["git_commit"][:7] for r in runs if r["git_commit"]})
    lines = [
        f"# {title}",
        "",
        f"{any_run['model']} on {any_run['dataset']}, global batch "
        f"{any_run['global_batch_size']}, {len(seeds)} seed(s) "
        f"({', '.join(map(str, seeds))}), {len(runs)} runs, parallel "
        f"mode(s): {', '.join(sorted({r['parallel'] for r in runs}))}, "
        f"precision {', '.join(sorted({r['precision'] or 'fp32' for r in runs}))}, "
        f"commit {', '.join(commits) or 'unknown'}.",
        "",
        f"Machines: {machines(runs)}.",
    ]
    if wall_time_s is not None:
        lines.append(f"The sweep took {wall_time_s / 60:.1f} minutes of wall time.")
    if study.failures:
        lines += tables.missing_section(study.failures)
    lines += tables.error_table(study)
    lines += tables.noise_section(study)
    lines += tables.paired_section(study)
    lines += tables.recovery_section(study)
    lines += tables.loss_table(study)
    lines += convergence.speed_section(study)
    lines += convergence.batch_stats_section(study)
    lines += convergence.accumulation_section(study)
    if earlier is not None:
        lines += convergence.survival_section(study, earlier[1], earlier[0])
    if study.ddp:
        lines += tables.cost_section(study)
        lines += tables.spot_check_section(study)
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    lines += tables.anchors_section(study)
    lines += ["", "## Reading", ""] + reading(study)
    return "\n".join(lines) + "\n"
