"""The converged study's sections (report/convergence.py) against planted runs: steps to reach
a validation accuracy, the three ways of testing, accumulation against devices, and which
claims survive from an earlier study; and an earlier study read back from its results.csv."""

import math
from pathlib import Path

from planted import write_report

from syncbn_lab.report.collect import Run, runs_from_csv, steps_to
from syncbn_lab.report.convergence import (
    accumulation_section,
    batch_stats_section,
    speed_section,
    survival_section,
)
from syncbn_lab.report.study import Study
from syncbn_lab.report.tables import spot_check_section

SEEDS = (0, 1, 2)
SHIFT = (0.0, 0.3, -0.2)  # each seed's own offset, the same in every cell


def run(bn, devices, seed, error, accumulate=1, val=(), batch_stats=None, loss=0.2):
    per_device = 64 // (devices * accumulate)
    summary = {
        "bn": bn, "parallel": "emulated", "devices": devices, "accumulate": accumulate,
        "per_device_batch_size": per_device,
        "normalization_batch_size": 64 if bn == "sync" else 1 if bn == "gn" else per_device,
        "global_batch_size": 64, "seed": seed, "test_acc": 100.0 - error - SHIFT[seed],
        "test_acc_precise_bn": 100.0 - error - SHIFT[seed] + 0.5,
        "test_acc_batch_stats": None if batch_stats is None else 100.0 - batch_stats - SHIFT[seed],
        "train_loss": loss, "steps": 400, "model": "resnet8", "dataset": "fashion_mnist",
        "git_commit": "abc1234", "wall_time_s": 1.0,
    }  # fmt: skip
    return Run(Path(f"{bn}{devices}x{accumulate}_s{seed}"), summary, [(10, 1.0)], list(val))


CURVE = [(100, 80.0), (200, 86.0), (300, 89.0), (400, 91.0)]


def test_steps_to_is_the_first_evaluated_step_at_or_above():
    r = run("bn", 1, 0, 8.0, val=CURVE)
    assert [steps_to(r, a) for a in (85, 86, 88, 90)] == [200, 200, 300, 400]
    assert math.isnan(steps_to(r, 95))


def study(bn_loss: dict[int, float], sync=10.0, noise=0.02) -> Study:
    """bn with ``bn_loss`` pp above sync at each per-device batch; sync at 1, 8, 64 devices
    with a small noise per device count."""
    runs = []
    for s in SEEDS:
        for i, devices in enumerate((1, 8, 64)):
            runs.append(run("sync", devices, s, sync + noise * ((i + s) % 3 - 1)))
        for batch, loss in bn_loss.items():
            runs.append(run("bn", 64 // batch, s, sync + loss + noise * (s - 1)))
    return Study(runs, [], [])


def test_speed_counts_runs_that_never_reach_and_averages_the_others():
    runs = [run("bn", 1, 0, 8, val=CURVE), run("bn", 1, 1, 8, val=[(s, a - 2) for s, a in CURVE]),
            run("bn", 1, 2, 8, val=[(s, a + 1) for s, a in CURVE])]  # fmt: skip
    text = "\n".join(speed_section(Study(runs, [], [])))
    # 90 %: 400 (seed 0), never (seed 1), 300 (seed 2); 85 %: 200, 300, 200
    assert "| bn | 64 | 233 ± 58 | 333 ± 58 | 350 ± 71 (2/3) | 0.2000 ± 0.0000 |" in text
    assert "about every 100 steps" in text


def test_batch_statistics_are_set_against_ema_paired_by_seed():
    runs = [run("bn", 32, s, 12.0, batch_stats=11.0) for s in SEEDS]
    runs += [run("bn", 1, s, 8.0) for s in SEEDS]  # no batch-statistics figure: no row
    text = "\n".join(batch_stats_section(Study(runs, [], [])))
    assert "| 2 | 12.03 ± 0.25 | 11.53 ± 0.25 | 11.03 ± 0.25 | -0.50 ± 0.00 | 0 | " \
           "-1.00 ± 0.00 | 0 |" in text  # fmt: skip
    assert "| 64 |" not in text


def test_accumulation_is_paired_with_the_same_normalisation_batch_on_devices():
    base = study({64: 0.0, 8: 1.0})
    runs = base.runs + [run("bn", 1, s, 11.25 + 0.02 * (s - 1), accumulate=8) for s in SEEDS]
    text = "\n".join(accumulation_section(Study(runs, [], [])))
    assert "| 8 | 8 |" in text and "| +0.25 ± 0.00 |" in text
    assert "bn, accumulated" not in text.split("|---")[0].split("\n")[-1]  # a table, not a name


def test_claims_survive_or_not_by_their_paired_test():
    before = study({64: 0.0, 8: 1.0, 2: 2.5})
    after = study({64: 0.0, 8: 0.01, 2: 1.0})  # BN's loss at 8 is within its noise there
    text = "\n".join(survival_section(after, before, "bn_vs_syncbn_1epoch"))
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()}
    assert rows["bn at 2 images per device is worse than sync"].endswith("| holds | unchanged |")
    assert rows["bn at 8 images per device is worse than sync"].endswith(
        "| holds | +0.01 ± 0.02 | 0.48 | not significant | holds → not significant |"
    )


def test_an_earlier_study_reads_back_from_its_results_csv(tmp_path):
    runs = study({64: 0.0, 2: 2.0}).runs
    for r in runs:  # write_report reads run dirs' names only
        r.run_dir = tmp_path / r.run_dir.name
    write_report(runs, tmp_path / "report", "t")
    back = runs_from_csv(tmp_path / "report" / "results.csv")
    cells = lambda rs: sorted((r["bn"], r["devices"], r["seed"], r.test_error) for r in rs)  # noqa: E731
    assert cells(back) == cells(runs)  # floats are written in full
    assert all(isinstance(r["per_device_batch_size"], int) for r in back)


def test_a_short_ddp_cost_run_is_no_twin_of_a_whole_emulated_run():
    base = study({64: 0.0, 16: 0.5})
    whole, short = run("bn", 4, 0, 10.5), run("bn", 4, 0, 30.0)
    for r, steps in ((whole, 400), (short, 200)):
        r.summary.update(parallel="ddp", steps=steps)
    text = "\n".join(spot_check_section(Study(base.runs, [whole, short], [])))
    assert text.count("| bn | 4 | 0 |") == 1 and "30.00" not in text
