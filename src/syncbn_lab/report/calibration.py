"""Test error against training length: the calibration that chooses how long the study trains.

The study's runs are one cosine schedule each, so a length is a run of its own. For each
per-device batch the calibration trains 1, 2, 4, ... epochs with the same seeds, and asks of
each doubling whether it still changes the test error: the change is paired by seed and set
against the float32 noise of a difference of two runs (sqrt(2) times the committed study's
noise floor of one run). A length whose doubling changes the error by less than that noise,
and not significantly, is on the plateau.
"""

from __future__ import annotations

import math
from typing import Any

from syncbn_lab.report import stats
from syncbn_lab.report.stats import Paired, mean_std, paired
from syncbn_lab.report.tables import table_row

COLUMNS = ("devices", "per_device_batch_size", "epochs", "seed", "steps", "test_acc",
           "test_acc_precise_bn", "train_loss", "train_time_s", "git_commit")  # fmt: skip


def by_seed(runs: list[dict[str, Any]], devices: int, epochs: int, key: str) -> dict[int, float]:
    """seed -> the metric of the run at ``devices`` and ``epochs`` (``test_error``,
    ``test_error_precise_bn`` or a summary key), through stats.by_seed."""

    def value(run: dict[str, Any]) -> float | None:
        if not key.startswith("test_error"):
            return run[key]
        acc = run[key.replace("test_error", "test_acc")]
        return None if acc is None else 100.0 - acc

    cell = [r for r in runs if r["devices"] == devices and r["epochs"] == epochs]
    return stats.by_seed(cell, value)


def doublings(runs: list[dict[str, Any]], devices: int) -> list[tuple[int, int, Paired]]:
    """(short, long, test error long - short paired by seed) for consecutive lengths."""
    lengths = sorted({r["epochs"] for r in runs if r["devices"] == devices})
    return [
        (short, long, paired(by_seed(runs, devices, long, "test_error"),
                             by_seed(runs, devices, short, "test_error")))
        for short, long in zip(lengths, lengths[1:], strict=False)
    ]  # fmt: skip


def smallest_against_largest(runs: list[dict[str, Any]]) -> list[tuple[int, Paired]]:
    """(epochs, test error at the most devices - at the fewest, paired by seed) for each
    length that both device counts trained."""
    few, many = min(r["devices"] for r in runs), max(r["devices"] for r in runs)
    lengths = sorted({r["epochs"] for r in runs if r["devices"] == few}
                     & {r["epochs"] for r in runs if r["devices"] == many})  # fmt: skip
    return [
        (e, paired(by_seed(runs, many, e, "test_error"), by_seed(runs, few, e, "test_error")))
        for e in lengths
    ]


def reading(delta: Paired) -> str:
    """The paired test's answer for a difference ``delta`` of test errors."""
    if not delta.significant:
        return "no difference detected" if delta.n > 1 else "one seed: no test"
    return "worse" if delta.mean > 0 else "better"


def within_noise(delta: Paired, floor: float) -> bool:
    """The mean change is at most the noise of a difference of two runs."""
    return abs(delta.mean) <= math.sqrt(2) * floor


def plateau(runs: list[dict[str, Any]], devices: int, floor: float) -> int | None:
    """The shortest length from which every doubling stays within the noise; None when the
    last doubling still changes the error beyond it."""
    found = None
    for short, _, delta in doublings(runs, devices):
        found = (found or short) if within_noise(delta, floor) else None
    return found


def _mean_std(values: dict[int, float], digits: int) -> str:
    mean, std = mean_std(values.values())
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def render(
    runs: list[dict[str, Any]],
    floor: float,
    meta: dict[str, str],
    experiment: str = "bn_vs_syncbn",
    global_batch: int = 64,
) -> str:
    """The calibration's README.md: test error and the last epoch's training loss per
    length, each doubling against the noise, and where the plateau starts, for runs of
    ``experiment`` at ``global_batch`` images a step."""
    devices = sorted({r["devices"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    noise = math.sqrt(2) * floor
    lines = [
        "# How long the study must train: test error against epochs",
        "",
        f"bn (per-device BatchNorm) on Fashion-MNIST with `experiment={experiment}` (resnet8, "
        f"global batch {global_batch}, cosine schedule over the run, the study's configuration), "
        f"trained for {', '.join(str(e) for e in sorted({r['epochs'] for r in runs}))} epochs "
        f"with seeds {', '.join(map(str, seeds))}. Each doubling of the length is compared "
        "paired by seed and set against the noise of a difference of two float32 runs, "
        f"{noise:.2f} pp (sqrt(2) times the committed study's {floor:.2f} pp per run).",
        "",
        f"Produced by `{meta['command']}`, the runs at commit {meta['commit']}, on "
        f"{meta['machine']}; {len(runs)} runs, {meta['wall']}.",
        "",
        table_row("images per device", "epochs", "steps", "test error, EMA (%)",
             "test error, PreciseBN (%)", "last epoch's training loss", "training time (s)"),
        table_row(*["---"] * 7),
    ]  # fmt: skip
    for d in devices:
        for e in sorted({r["epochs"] for r in runs if r["devices"] == d}):
            steps = by_seed(runs, d, e, "steps")
            lines.append(
                table_row(
                    global_batch // d,
                    e,
                    int(next(iter(steps.values()))),
                    _mean_std(by_seed(runs, d, e, "test_error"), 2),
                    _mean_std(by_seed(runs, d, e, "test_error_precise_bn"), 2),
                    _mean_std(by_seed(runs, d, e, "train_loss"), 4),
                    f"{mean_std(by_seed(runs, d, e, 'train_time_s').values())[0]:.0f}",
                )
            )
    lines += [
        "",
        "Each doubling (test error, EMA statistics; long - short, paired by seed):",
        "",
        table_row("images per device", "epochs", "change (pp)", "p", "verdict"),
        table_row(*["---"] * 5),
    ]
    for d in devices:
        per_device = global_batch // d
        for short, long, delta in doublings(runs, d):
            p = "–" if math.isnan(delta.p) else f"{delta.p:.3f}"
            verdict = "within the noise" if within_noise(delta, floor) else "beyond the noise"
            lines.append(
                table_row(per_device, f"{short} → {long}", f"{delta.mean:+.2f} ± {delta.std:.2f} "
                     f"(n={delta.n})", p, verdict)
            )  # fmt: skip
    if len(devices) > 1:
        small, large = global_batch // devices[-1], global_batch // devices[0]
        lines += [
            "",
            f"{small} images per device against {large} at each length (test error, EMA "
            f"statistics; {small} - {large}, paired by seed; the paired t-test at 5 %):",
            "",
            table_row("epochs", "difference (pp)", "p", f"{small} images per device is"),
            table_row(*["---"] * 4),
        ]
        for e, delta in smallest_against_largest(runs):
            p = "–" if math.isnan(delta.p) else f"{delta.p:.3f}"
            lines.append(
                table_row(e, f"{delta.mean:+.2f} ± {delta.std:.2f} (n={delta.n})", p,
                          reading(delta))
            )  # fmt: skip
    lines += ["", "Where the test error stops changing beyond the noise:", ""]
    for d in devices:
        start = plateau(runs, d, floor)
        longest = max(r["epochs"] for r in runs if r["devices"] == d)
        if start is None:
            lines.append(
                f"- {global_batch // d} images per device: not yet at {longest} epochs (its last "
                "doubling still changes the error beyond the noise)."
            )
        else:
            lines.append(f"- {global_batch // d} images per device: from {start} epochs on.")
    return "\n".join(lines) + "\n"
