"""The variants study's report (``sweep.report.writer: variants``: variants x per-device
batch, e.g. experiment=bn_vs_syncbn): results.csv, README.md (tables, paired tests, the cost
table, a reading) and plots.

The figures come from :mod:`~.study`, the tables from :mod:`~.tables`, the reading from
:mod:`~.reading` and the plots from :mod:`~.plots`; this module puts them in one document.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from syncbn_lab.errors import UserError
from syncbn_lab.parallel.modes import mode
from syncbn_lab.report import convergence, header, tables
from syncbn_lab.report.collect import Run, runs_from_csv
from syncbn_lab.report.plots import PLOTS, write_plots
from syncbn_lab.report.reading import reading
from syncbn_lab.report.source import Source
from syncbn_lab.report.spec import repository
from syncbn_lab.report.study import CELLS, Study, variant_order
from syncbn_lab.variants import GROUP, variant


def write(source: Source, out_dir: Path) -> list[str]:
    """results.csv (unless the runs come from one), README.md and the plots of the study;
    the failed runs' cells marked missing with each one's reason, its claims beside those of
    the earlier study the experiment names (``sweep.report.compare_with``)."""
    if source.spec.cells != CELLS:
        raise UserError(
            f"the variants report's cells are {', '.join(CELLS)}; experiment="
            f"{source.spec.experiment} declares {', '.join(source.spec.cells)}"
        )
    runs = source.runs
    _normalization_batch(runs, from_csv=source.csv is not None)  # before anything is written
    one_process = [r for r in runs if not _distributed(r)]
    distributed = [r for r in runs if _distributed(r)]
    main = one_process or runs
    written = source.write_results(
        out_dir, order=lambda r: (r[GROUP], r["parallel"], r["devices"], r["seed"])
    )
    drawn = write_plots(main, out_dir, variant_order(main))
    # plots drawn from run dirs that are gone (their curves) stay linked
    plots = [p for p in PLOTS if p in drawn or (out_dir / p).is_file()]
    study = Study(main, distributed if one_process else [], source.failures)
    before = None
    if source.spec.compare_with is not None:
        path = repository() / source.spec.compare_with
        emulated = [r for r in runs_from_csv(path) if not _distributed(r)]
        before = (path.parent.name, Study(emulated, [], []))
    (out_dir / "README.md").write_text(markdown(source, study, plots, before))
    return ["README.md", *written, *drawn]


def _distributed(run: Run) -> bool:
    """A real multi-process run (DDP), set apart from its emulated twins."""
    return mode(run["parallel"]).distributed


def _normalization_batch(runs: list[Run], from_csv: bool) -> None:
    """Every run's normalisation batch: a results.csv written before it had the column gives
    it through each run's variant (its default settings, as a run then computed it); run dirs
    without it are refused."""
    lacking = [r for r in runs if not isinstance(r["normalization_batch_size"], int)]
    if lacking and not from_csv:
        raise UserError(
            f"{len(lacking)} run(s) have no normalization_batch_size in summary.json (e.g. "
            f"{lacking[0].run_dir}); rerun them with the current code"
        )
    for r in lacking:
        r.summary["normalization_batch_size"] = variant(r.summary[GROUP]).normalization_batch_size(
            OmegaConf.create({}), r["per_device_batch_size"], r["devices"]
        )


def markdown(
    source: Source, study: Study, plots: list[str], earlier: tuple[str, Study] | None = None
) -> str:
    """The whole README.md of ``study`` (and its claims beside ``earlier``'s)."""
    lines = [
        f"# {source.spec.title}",
        "",
        header.setting(source),
        "",
        header.provenance(source),
    ]
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
