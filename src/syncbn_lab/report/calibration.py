"""The calibration of a study's length (``sweep.report.writer: calibration``): test error
against training length, to choose how long the study trains.

Each run is one schedule over its length, so a length is a run of its own. The experiment
declares the lengths and device counts (its grid) and two comparisons: ``doublings`` (each
length against the next shorter one at the same device count) and ``small_against_large``
(the most devices against the fewest at each length). Each change is paired by seed and read
against the float32 noise of a difference of two runs; what is this report's own is where
the plateau starts: the shortest length from which every doubling stays within that noise.
"""

from __future__ import annotations

from collections import defaultdict

from syncbn_lab.report import header
from syncbn_lab.report.cells import Cell, Cells
from syncbn_lab.report.collect import Run, loss_ratio
from syncbn_lab.report.source import Source
from syncbn_lab.report.stats import Paired, difference_noise, mean_std
from syncbn_lab.report.text import fmt_p, fmt_paired, over_seeds, table_head, table_row
from syncbn_lab.report.verdicts import against_noise, outcome
from syncbn_lab.variants import GROUP, with_role


def doublings(cells: Cells) -> dict[int, list[tuple[int, int, Paired]]]:
    """devices -> (short, long, test error long - short paired by seed) for each length and
    the next shorter one, shortest first."""
    out: dict[int, list[tuple[int, int, Paired]]] = defaultdict(list)
    for long, short in cells.pairs("doublings"):
        out[long["devices"]].append((short["epochs"], long["epochs"], cells.against(long, short)))
    return {d: sorted(steps, key=lambda s: s[0]) for d, steps in sorted(out.items())}


def plateau(steps: list[tuple[int, int, Paired]], noise: float) -> int | None:
    """The shortest length from which every doubling changes the mean error by at most
    ``noise``; None when the last doubling still changes it by more."""
    found = None
    for short, _, delta in steps:
        found = (found or short) if abs(delta.mean) <= noise else None
    return found


def per_device(cells: Cells, devices: int) -> object:
    """Images per device of the cells at ``devices``, as their runs record it."""
    return cells.recorded("per_device_batch_size", *cells.select({"devices": devices}))


def markdown(source: Source, cells: Cells) -> str:
    """The calibration's README.md: test error and the last epoch's training loss per
    length, each doubling against the noise, the most devices against the fewest, and where
    the plateau starts."""
    noise = difference_noise(source.noise["test_error"].std)
    shown = varying(cells)
    variants = len({r[GROUP] for r in source.runs}) > 1  # a noise part beside the grid
    lengths = sorted({c["epochs"] for c in cells.declared})
    seeds = sorted({r["seed"] for r in source.runs})
    baseline = with_role("baseline")[0]
    lines = [
        f"# {source.spec.title}",
        "",
        f"{header.setting(source)} {baseline.name} ({baseline.label}) trained for "
        f"{', '.join(map(str, lengths))} epochs with seeds {', '.join(map(str, seeds))}, each "
        f"run one {source.spec.config.sched.name} schedule over its length. Each doubling of "
        f"the length is compared paired by seed; {header.noise(source)}.",
        "",
        header.provenance(source),
        "",
        *table_head(*shown, *(["variant"] if variants else []), "images per device", "epochs",
                    "steps", "test error, EMA (%)", "test error, PreciseBN (%)",
                    "last epoch's training loss", "training time (s)"),
    ]  # fmt: skip
    by_devices = sorted(cells.declared, key=lambda c: (*(c[k] for k in shown), c["devices"],
                                                       c["epochs"]))  # fmt: skip
    for cell in by_devices:
        runs = cells.by_cell.get(cell, [])
        variant = [", ".join(sorted({r[GROUP] for r in runs})) or "–"] if variants else []
        lines.append(_row(cells, cell, runs, [*(cell[k] for k in shown), *variant]))
    lines += [
        "",
        "Each doubling (test error, EMA statistics; long - short, paired by seed):",
        "",
        *table_head("images per device", "epochs", "change (pp)", "p", "reading"),
    ]
    steps = doublings(cells)
    for devices, found in steps.items():
        for short, long, delta in found:
            lines.append(table_row(per_device(cells, devices), f"{short} → {long}",
                                   fmt_paired(delta, count=True), fmt_p(delta.p),
                                   against_noise(delta, noise)))  # fmt: skip
    pairs = cells.pairs("small_against_large")
    if pairs:
        small, large = (per_device(cells, c["devices"]) for c in pairs[0])
        lines += [
            "",
            f"{small} images per device against {large} at each length (test error, EMA "
            f"statistics; {small} - {large}, paired by seed; the paired t-test at 5 %):",
            "",
            *table_head("epochs", "difference (pp)", "p", f"{small} images per device is worse"),
        ]
        for cell, other in sorted(pairs, key=lambda p: p[0]["epochs"]):
            delta = cells.against(cell, other)
            lines.append(table_row(cell["epochs"], fmt_paired(delta, count=True),
                                   fmt_p(delta.p), outcome(delta)))  # fmt: skip
    lines += ["", "Where the test error stops changing beyond the noise:", ""]
    for devices, found in steps.items():
        start, images = plateau(found, noise), per_device(cells, devices)
        short, long, last = found[-1]
        if start is None and last.mean > noise:
            lines.append(
                f"- {images} images per device: the error rises beyond the noise over the "
                f"last doubling ({short} → {long} epochs, {fmt_paired(last)} pp): longer "
                "training raises it."
            )
        elif start is None:
            lines.append(
                f"- {images} images per device: not yet at {long} epochs (its last "
                "doubling still changes the error beyond the noise)."
            )
        else:
            lines.append(f"- {images} images per device: from {start} epochs on.")
    if WIDTH in shown:
        lines += ["", *widths_table(cells)]
    return "\n".join(lines) + "\n"


WIDTH = "model.width"


def varying(cells: Cells) -> list[str]:
    """The cell keys besides devices and epochs whose value differs between declared cells
    (a calibration of widths as well as lengths)."""
    return [k for k in cells.keys if k not in ("devices", "epochs")
            and len({c[k] for c in cells.declared}) > 1]  # fmt: skip


def widths_table(cells: Cells) -> list[str]:
    """Each width over the whole batch (the fewest devices), at the length that trained the
    most widths (of those, the longest): how far it is from fitting its training set, the
    training loss over the test loss."""
    fewest = min(c["devices"] for c in cells.declared)
    trained = [c for c in cells.declared if c["devices"] == fewest and cells.by_cell.get(c)]
    widths = {e: len({c[WIDTH] for c in trained if c["epochs"] == e})
              for e in {c["epochs"] for c in trained}}  # fmt: skip
    length = max(widths, key=lambda e: (widths[e], e))
    at = sorted((c for c in trained if c["epochs"] == length), key=lambda c: c[WIDTH])
    lines = [
        f"Each width over the whole batch ({per_device(cells, fewest)} images per device) for "
        f"{length} epochs: the last epoch's training loss over the test loss says how far the "
        "model is from fitting its training set (near 0: it fits; near 1 or above: it "
        "underfits). Mean ± std over seeds.",
        "",
        *table_head("width", "seeds", "test error, EMA (%)", "last epoch's training loss",
                    "test loss", "training loss over test loss"),
    ]  # fmt: skip
    for cell in at:
        runs = [r for r in cells.by_cell[cell] if r["test_loss"]]
        lines.append(table_row(
            cell[WIDTH], len(runs), over_seeds(r.test_error for r in runs),
            over_seeds((r["train_loss"] for r in runs), 4),
            over_seeds((r["test_loss"] for r in runs), 4),
            over_seeds(map(loss_ratio, runs), 3),
        ))  # fmt: skip
    return lines


def _row(cells: Cells, cell: Cell, runs: list[Run], first: list) -> str:
    steps = {r["steps"] for r in runs}
    return table_row(
        *first, per_device(cells, cell["devices"]), cell["epochs"],
        int(steps.pop()) if len(steps) == 1 else "–",
        over_seeds(r.test_error for r in runs), over_seeds(r.test_error_precise_bn for r in runs),
        over_seeds((r["train_loss"] for r in runs), 4),
        "–" if not runs else f"{mean_std(r['train_time_s'] for r in runs)[0]:.0f}",
    )  # fmt: skip
