"""The opening of every report: what the runs trained (as they record it, else as the study's
experiment declares it), and where the figures come from: the command that writes the report
again, the runs found against those declared, the training code, the machines and the time."""

from __future__ import annotations

import math
from collections import Counter

from syncbn_lab.report.source import Source
from syncbn_lab.report.spec import OWN
from syncbn_lab.report.stats import difference_noise
from syncbn_lab.variants import with_role


def recorded(source: Source, key: str, config_key: str) -> list:
    """The values the runs record for ``key``, sorted; the experiment's ``config_key`` where
    none does (a results.csv without that column)."""
    from omegaconf import OmegaConf

    values = {r[key] for r in source.runs if r[key] is not None}
    if values:
        return sorted(values)
    return [OmegaConf.select(source.spec.config, config_key)]


def setting(source: Source) -> str:
    """The model, data, global batch, precision, parallel modes and seeds of the runs."""
    runs = source.runs
    seeds = sorted({r["seed"] for r in runs})
    precision = sorted({r["precision"] for r in runs if r["precision"]})
    model = ", ".join(recorded(source, "model", "model.name"))
    data = ", ".join(recorded(source, "dataset", "data.name"))
    batch = ", ".join(map(str, recorded(source, "global_batch_size", "trainer.global_batch_size")))
    modes = ", ".join(recorded(source, "parallel", "parallel.name"))
    return (
        f"{model} on {data}, global batch {batch}, precision "
        f"{', '.join(precision) or 'not recorded'}, parallel mode(s): {modes}, "
        f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))})."
    )


def provenance(source: Source, declared_runs: int | None = None) -> str:
    """Produced by (the command), runs found (of ``declared_runs``), code, machines, time."""
    runs = source.runs
    found = f"{len(runs)} runs"
    if declared_runs is not None:
        found = f"{len(runs)} of {declared_runs} declared runs finished"
        if declared_runs > len(runs):
            found += f"; {declared_runs - len(runs)} not yet ({len(source.failures)} failed)"
    parts = [f"Produced by `{source.command}`.", f"{found}.", code(runs), machines(runs)]
    return " ".join([*parts, time(source)] if time(source) else parts)


def code(runs) -> str:
    """The training code the runs record (provenance.training_code) and their commits."""
    commits = sorted({r["git_commit"][:7] for r in runs if r["git_commit"]})
    codes = sorted({r["training_code"] for r in runs if r["training_code"]})
    listed = ", ".join(commits) or "not recorded"
    if not codes:
        return f"Commits {listed}." if len(commits) > 1 else f"Commit {listed}."
    if len(codes) == 1 and all(r["training_code"] for r in runs):
        return f"One training code (`training_code` {codes[0]}; commits {listed})."
    return (
        f"**{len(codes)} training codes** ({', '.join(codes)}; commits {listed}): the runs "
        "did not all train with the same code."
    )


def machines(runs) -> str:
    """The CPUs the runs ran on, with the vector ISA and precision they recorded, and how many
    runs each: what decides their speed and whether bf16 was native."""
    counts: Counter[str] = Counter()
    for r in runs:
        if r["cpu_model"] is None:
            continue
        counts[f"{r['cpu_model']} ({r['cpu_isa'] or 'ISA not recorded'}, "
               f"{r['precision'] or 'precision not recorded'})"] += 1  # fmt: skip
    if not counts:
        return "Machines: not recorded."
    listed = (f"{m}: {n} run{'' if n == 1 else 's'}" for m, n in counts.items())
    return "Machines: " + "; ".join(listed) + "."


def time(source: Source) -> str:
    """The sweep's wall time (all its attempts), else the runs' own summed."""
    if source.wall_time_s is not None and not math.isnan(source.wall_time_s):
        attempts = len(source.attempts)
        within = f" in {attempts} attempt(s)" if attempts else ""
        return f"The sweep took {source.wall_time_s / 60:.1f} min of wall time{within}."
    for key, what in (("wall_time_s", "wall time"), ("train_time_s", "training time")):
        values = [r[key] for r in source.runs if r[key] is not None]
        if values:
            return f"The runs took {sum(values) / 60:.1f} min of {what} in all."
    return ""


def noise(source: Source, metric: str = "test_error", unit: str = " pp", digits: int = 2) -> str:
    """The float32 noise of a difference of two runs in ``metric``, and where it comes from."""
    floor = source.noise[metric].std
    where = source.spec.noise_floor
    where = "this study" if where == OWN else where
    return (
        f"the noise of a difference of two float32 runs is "
        f"{difference_noise(floor):.{digits}f}{unit}: √2 times the spread of one run, "
        f"{floor:.{digits}f}{unit}, which {with_role('reference')[0].label} runs of one seed "
        f"show across device counts in {where}"
    )
