"""The reports' PNG plots and their one style (:func:`subplots`, :func:`log2_axis`,
:func:`save`): for the variants study, test error against the per-device and the
normalisation batch, the training-loss and validation-error curves per per-device batch, and,
at a glance, test error and the steps to reach a validation accuracy against images per
device."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from syncbn_lab.report.collect import Run
from syncbn_lab.report.stats import mean_std
from syncbn_lab.report.study import per_sample
from syncbn_lab.variants import GROUP, VARIANTS

X_AXES = {
    "per_device_batch_size": "images per device (global batch fixed)",
    "normalization_batch_size": "images per normalisation batch (global batch fixed)",
}
"""The x axes of the test-error plots: a summary.json key -> its label."""

ZOOM_FROM = 2
"""The right panel of a test-error plot shows per-device batches from this size up."""
DPI = 110
PLOTS = (
    "at_a_glance.png",
    "test_error_vs_per_device_batch.png",
    "test_error_vs_normalization_batch.png",
    "train_loss_curves.png",
    "val_error_curves.png",
)
"""The variants study's plots, in the order its README shows them."""


def subplots(*args, **kwargs):
    """``matplotlib.pyplot.subplots`` drawing to files only (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def log2_axis(ax, ticks=None, which: str = "major") -> None:
    """A log2 x axis whose ticks read as plain numbers (``ticks``: where they are), gridded."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log", base=2)
    if ticks is not None:
        ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which=which, alpha=0.3)


def save(fig, path: Path, rect: tuple[float, float, float, float] | None = None) -> None:
    """Lay out ``fig`` (its axes within ``rect``, figure fractions, where a legend below them
    needs room), write it to ``path`` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def write_plots(runs: list[Run], out_dir: Path, variants: list[str]) -> list[str]:
    """Every plot of ``runs`` into ``out_dir``; their file names."""
    names = [_glance_plot(runs, out_dir, variants)] if any(r.val_curve for r in runs) else []
    names += [_error_plot(runs, out_dir, variants, x_axis) for x_axis in X_AXES]
    with_curves = [v for v in variants if _has_curves(v)]
    for curve in CURVES:
        name = _curves(runs, out_dir, with_curves, curve)
        names += [name] if name else []
    return names


def _has_curves(name: str) -> bool:
    """The loss curves show the study's batch-dependent variants (baseline, reference and
    the remedies with running statistics)."""
    spec = VARIANTS.get(name)
    return spec is not None and spec.role is not None and not spec.per_sample


def _series(runs: list[Run], variants: list[str], x_axis: str):
    """(label, style, xs, means, stds) per line: EMA for every batch-dependent variant,
    PreciseBN dashed for the baseline; a per-sample variant as (label, None, [], mean, std)."""
    for v in variants:
        spec = VARIANTS.get(v)
        members = [r for r in runs if r[GROUP] == v]
        if spec is not None and spec.per_sample:
            m, s = mean_std([r.test_error for r in members])
            yield f"{v} (±{s:.2f})", None, [], m, s
            continue
        cells = defaultdict(list)
        for r in members:
            cells[r[x_axis]].append(r)
        xs = sorted(cells)
        lines = [("test_error", "-o", f"{v} (EMA)")]
        if spec is not None and spec.role == "baseline":
            lines.append(("test_error_precise_bn", "--s", f"{v} (PreciseBN)"))
        for attr, style, label in lines:
            points = [mean_std([getattr(r, attr) for r in cells[x]]) for x in xs]
            if all(math.isnan(m) for m, _ in points):
                continue
            yield label, style, xs, [m for m, _ in points], [s for _, s in points]


def _error_plot(runs: list[Run], out_dir: Path, variants: list[str], x_axis: str) -> str:
    """Two panels: every batch on a log error axis, and the zoom on ZOOM_FROM and up."""
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    fig, axes = subplots(1, 2, figsize=(12, 4.4))
    ticks: set[int] = set()
    for panel, ax in enumerate(axes):
        for label, style, xs, means, stds in _series(runs, variants, x_axis):
            if style is None:
                ax.axhline(means, color="grey", linestyle=":", label=label)
                ax.axhspan(means - stds, means + stds, color="grey", alpha=0.12)
                continue
            keep = [i for i, x in enumerate(xs) if panel == 0 or x >= ZOOM_FROM]
            if not keep:
                continue
            ticks |= {xs[i] for i in keep}
            ms, ss = [means[i] for i in keep], [stds[i] for i in keep]
            # on the log panel the lower bar is clipped so the axis never sees an error <= 0
            lower = [max(0.0, min(s, 0.9 * m)) for m, s in zip(ms, ss, strict=True)]
            ax.errorbar(
                [xs[i] for i in keep],
                ms,
                yerr=[lower if panel == 0 else ss, ss],
                fmt=style,
                capsize=3,
                label=label,
            )
        log2_axis(ax, sorted(t for t in ticks if panel == 0 or t >= ZOOM_FROM), which="both")
        ax.invert_xaxis()
        ax.set_xlabel(X_AXES[x_axis])
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_formatter(plain)
    axes[0].yaxis.set_minor_formatter(plain)
    axes[0].set_ylabel("test error (%), mean ± std over seeds")
    axes[0].set_title("all batches (log scale)")
    axes[1].set_title(f"{ZOOM_FROM} images and more (linear scale)")
    axes[1].legend(fontsize=8)
    name = f"test_error_vs_{x_axis.removesuffix('_size')}.png"
    save(fig, out_dir / name)
    return name


CURVES = {  # file stem -> (Run attribute, y label, value plotted, log y axis)
    "train_loss_curves": ("loss_curve", "training loss (mean over seeds)", lambda v: v, True),
    "val_error_curves": ("val_curve", "validation error (%), mean over seeds",
                         lambda acc: 100.0 - acc, False),
}  # fmt: skip


def _curves(runs: list[Run], out_dir: Path, variants: list[str], stem: str) -> str | None:
    """One panel per variant: the mean curve over seeds (CURVES[stem]) per per-device batch."""
    attr, ylabel, value, log = CURVES[stem]
    if not variants or not any(getattr(r, attr) for r in runs):
        return None
    from matplotlib.ticker import FuncFormatter

    batches = sorted({r["per_device_batch_size"] for r in runs}, reverse=True)
    color = {b: f"C{i % 10}" for i, b in enumerate(batches)}  # one colour per batch, all panels
    fig, axes = subplots(1, len(variants), figsize=(5.5 * len(variants), 4), sharey=True)
    axes = [axes] if len(variants) == 1 else list(axes)
    for ax, v in zip(axes, variants, strict=True):
        by_batch = defaultdict(list)
        for r in runs:
            if r[GROUP] == v and getattr(r, attr):
                by_batch[r["per_device_batch_size"]].append(dict(getattr(r, attr)))
        for batch in sorted(by_batch, reverse=True):
            curves = by_batch[batch]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(
                steps,
                [statistics.fmean(value(c[s]) for c in curves) for s in steps],
                label=f"{batch} per device",
                color=color[batch],
                linewidth=1,
            )
        ax.set_title(f"{GROUP}={v}")
        ax.set_xlabel("optimizer step")
        if log:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel(ylabel)
    save(fig, out_dir / f"{stem}.png")
    return f"{stem}.png"


def _glance_plot(runs: list[Run], out_dir: Path, variants: list[str]) -> str:
    """Left: test error against images per device, one line per variant (mean ± std over
    seeds); right: the steps to reach the highest of convergence.THRESHOLDS, the same way."""
    from syncbn_lab.report.collect import steps_to
    from syncbn_lab.report.convergence import THRESHOLDS

    accuracy = THRESHOLDS[-1]
    fig, axes = subplots(1, 2, figsize=(12, 4.4))
    measures = (
        (lambda r: r.test_error, "test error (%), mean ± std over seeds"),
        (lambda r: steps_to(r, accuracy), f"steps to {accuracy:g} % validation accuracy"),
    )
    for ax, (value, label) in zip(axes, measures, strict=True):
        for i, v in enumerate(variants):
            members = [r for r in runs if r[GROUP] == v]
            if per_sample(v):
                m, s = mean_std(value(r) for r in members)
                ax.axhline(m, color="grey", linestyle=":", label=f"{v} (any batch)")
                ax.axhspan(m - s, m + s, color="grey", alpha=0.12)
                continue
            cells = defaultdict(list)
            for r in members:
                cells[r["per_device_batch_size"]].append(value(r))
            xs = sorted(b for b in cells if b >= ZOOM_FROM)
            points = [mean_std(cells[x]) for x in xs]
            if xs and not all(math.isnan(m) for m, _ in points):
                ax.errorbar(xs, [m for m, _ in points], yerr=[s for _, s in points],
                            fmt="-o", capsize=3, label=v, color=f"C{i % 10}")  # fmt: skip
        log2_axis(ax, which="both")
        ax.invert_xaxis()
        ax.set_xlabel(f"images per device ({ZOOM_FROM} and more; global batch fixed)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    save(fig, out_dir / "at_a_glance.png")
    return "at_a_glance.png"
