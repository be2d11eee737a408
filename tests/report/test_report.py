"""The report from run dirs written by the test: a fake sweep with planted effects (BN
loses from 8 images per device down, Batch Renormalization wins back half of it, SyncBN is
flat up to a small noise) whose tables and reading are checked against the plant."""

import csv
import json
import statistics

import numpy as np
import pytest
from planted import write_report
from scipy import stats as scipy_stats

from syncbn_lab.errors import UserError
from syncbn_lab.report import collect_failures, collect_runs

SEEDS = range(4)
DEVICES = (1, 2, 4, 8, 16, 32, 64)
SEED_OFFSET = [0.0, 0.4, -0.3, 0.2]
# float32 noise of each run (sd 0.05 pp), drawn once for every (variant, seed, devices)
NOISE = {
    (bn, seed, devices): value
    for bn, rng in (("bn", 1), ("sync", 2), ("brn", 3), ("gn", 4))
    for seed, row in zip(SEEDS, np.random.default_rng(rng).normal(0, 0.05, (4, 7)), strict=True)
    for devices, value in zip(DEVICES, row, strict=True)
}
BN_LOSS = {64: 0.0, 32: 0.0, 16: 0.0, 8: 0.6, 4: 1.2, 2: 2.5, 1: 30.0}  # pp of test error
STEP_TIME = {"bn": 0.050, "sync": 0.080, "brn": 0.055, "gn": 0.060}


def planted_error(bn, seed, devices):
    """The test error of a run, as the report reads it back from test_acc."""
    base = 10.0 + SEED_OFFSET[seed] + NOISE[(bn, seed, devices)]
    loss = BN_LOSS[64 // devices]
    error = {"sync": base, "bn": base + loss, "brn": base + loss / 2, "gn": base + 1.0}[bn]
    return 100.0 - (100.0 - error)


def fake_run(root, bn, devices, seed, error, parallel="emulated", loss=0.3, extra=None):
    run_dir = root / f"{bn}_{parallel}{devices}_s{seed}"
    run_dir.mkdir(parents=True)
    per_device = 64 // devices
    summary = dict(
        bn=bn,
        parallel=parallel,
        devices=devices,
        per_device_batch_size=per_device,
        normalization_batch_size={"sync": 64, "gn": 1}.get(bn, per_device),
        global_batch_size=64,
        seed=seed,
        test_acc=100.0 - error,
        test_acc_precise_bn=None if bn == "gn" else 100.0 - error + 0.1,
        train_loss=loss,
        steps=10,
        wall_time_s=1.0,
        dataset="fashion_mnist",
        model="resnet8",
        git_commit="abcdef1234567",
        **(extra or {}),
    )
    (run_dir / "summary.json").write_text(json.dumps(summary))
    steps = [{"step": s, "train/loss": loss * (11 - s)} for s in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, steps)) + "\n")


def traffic(bn, devices):
    norm = 8136 if bn == "sync" else 0
    return {
        "step_time_s": STEP_TIME[bn] * devices / 2,
        "comm_bytes_per_step": 311016 + 2760 + norm,
        "comm_gradients_bytes_per_step": 311016,
        "comm_buffers_bytes_per_step": 2760,
        "comm_norm_statistics_bytes_per_step": norm,
        "comm_calls_per_step": 2 + 18 * (bn == "sync"),
    }


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    for seed in SEEDS:
        for devices in DEVICES:
            for bn in ("bn", "sync"):
                loss = 0.3 + 0.01 * np.log2(devices) + NOISE[(bn, seed, devices)] / 100
                fake_run(root, bn, devices, seed, planted_error(bn, seed, devices), loss=loss)
        for devices in (8, 16, 32, 64):
            fake_run(root, "brn", devices, seed, planted_error("brn", seed, devices))
        fake_run(root, "gn", 1, seed, planted_error("gn", seed, 1))
    (root / "unfinished").mkdir()  # no summary.json: skipped
    for bn, devices in (("bn", 2), ("bn", 4), ("sync", 2), ("sync", 4), ("brn", 2), ("gn", 2)):
        error = planted_error("sync", 0, devices) + (0.02 if bn != "gn" else 1.0)
        if bn == "bn":
            error += BN_LOSS[64 // devices]
        fake_run(
            tmp_path / "ddp", bn, devices, 0, error, parallel="ddp", extra=traffic(bn, devices)
        )
    return tmp_path


@pytest.fixture
def report(sweep):
    runs = collect_runs(sweep / "sweep", sweep / "ddp")
    write_report(runs, sweep / "report", "Test report", wall_time_s=600)
    return sweep / "report"


def section(text, heading):
    return text.split(f"## {heading}")[1].split("\n## ")[0]


def table_rows(text):
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]


def test_csv_has_every_run_and_no_machine_paths(report):
    rows = list(csv.DictReader(open(report / "results.csv")))
    assert len(rows) == 4 * (14 + 4 + 1) + 6
    assert all("/" not in row["run_dir"] for row in rows)
    ddp = [row for row in rows if row["parallel"] == "ddp"]
    assert {row["comm_norm_statistics_bytes_per_step"] for row in ddp} == {"0", "8136"}
    assert {row["git_commit"] for row in rows} == {"abcdef1234567"}


def test_header_error_table_and_noise_floor(report):
    text = (report / "README.md").read_text()
    assert "resnet8 on fashion_mnist, global batch 64, precision not recorded" in text
    assert "parallel mode(s): ddp, emulated, 4 seed(s) (0, 1, 2, 3)." in text
    assert "82 runs. Commit abcdef1. Machines: not recorded." in text
    assert "The sweep took 10.0 min of wall time." in text
    errors = [planted_error("bn", s, 64) for s in SEEDS]  # bn at 1 image per device
    table = {row[0]: row for row in table_rows(section(text, "Test error"))}
    assert table["1"][1] == f"{statistics.fmean(errors):.2f} ± {statistics.stdev(errors):.2f}"
    assert table["64"][3] == "–"  # no brn at 64 images per device
    # the floor: sync's within-seed spread over device counts is the planted noise
    x = np.array([[planted_error("sync", s, d) for d in DEVICES] for s in SEEDS])
    within = x - x.mean(axis=1, keepdims=True)
    floor = np.sqrt((within**2).sum() / (4 * 6))
    assert f"**{floor:.2f} pp** in test error" in section(text, "The float32 noise floor")


def test_paired_comparisons_against_the_largest_per_device_batch(report):
    text = (report / "README.md").read_text()
    rows = {(r[0], r[1]): r for r in table_rows(section(text, "Against per-device BN"))[1:]}
    for devices in (2, 4, 8, 16, 32, 64):
        bn = [planted_error("bn", s, devices) for s in SEEDS]
        one = [planted_error("bn", s, 1) for s in SEEDS]
        diffs = np.subtract(bn, one)
        row = rows[("bn", str(64 // devices))]
        assert row[4] == f"{diffs.mean():+.2f} ± {diffs.std(ddof=1):.2f}"
        assert row[5] == f"{scipy_stats.ttest_rel(bn, one).pvalue:.2g}"
    assert rows[("sync", "1")][2] == "64"  # the normalisation batch of sync is the global one
    assert rows[("brn", "8")][2] == "8"


def test_recovery_of_bns_loss(report):
    text = (report / "README.md").read_text()
    rows = table_rows(section(text, "Recovering BN's loss"))[1:]

    def sync(seed):  # the reference of a seed: SyncBN's mean over its device counts
        return np.mean([planted_error("sync", seed, d) for d in DEVICES])

    def mean_diff(variant, devices):
        return np.mean([planted_error(variant, s, devices) - sync(s) for s in SEEDS])

    brn = {row[0]: row for row in rows if row[3] == "brn (EMA)"}
    assert sorted(brn, key=int) == ["1", "2", "4", "8"]
    for batch, row in brn.items():
        devices = 64 // int(batch)
        bn_loss, remaining = mean_diff("bn", devices), mean_diff("brn", devices)
        assert row[1].startswith(f"{bn_loss:+.2f} ± ")
        assert row[5].startswith(f"{remaining:+.2f} ± ")
        assert row[9] == f"{100 * (1 - remaining / bn_loss):.0f} %"
        assert abs(remaining / bn_loss - 0.5) < 0.15  # the planted half, up to the noise
    gn = {row[0]: row for row in rows if row[3] == "gn"}
    gn_remaining = mean_diff("gn", 1)
    assert gn["1"][9] == f"{100 * (1 - gn_remaining / mean_diff('bn', 64)):.0f} %"


def test_cost_and_spot_check(report):
    text = (report / "README.md").read_text()
    cost = {(r[0], r[1]): r for r in table_rows(section(text, "Cost under real DDP"))[1:]}
    assert cost[("sync", "2")][3:6] == ["80.0", f"{0.080 / 0.050:.2f}", "321,912"]
    assert cost[("sync", "2")][8:] == ["8,136", "20"]
    assert cost[("gn", "2")][4] == f"{0.060 / 0.050:.2f}"
    assert [r[0] for r in cost.values() if r[1] == "2"] == ["bn", "brn", "sync", "gn"]
    spot = {(r[0], r[1]): r for r in table_rows(section(text, "Real DDP against the emulation"))}
    assert spot[("sync", "4")][5] == "+0.02"  # DDP - emulated, as planted
    assert ("gn", "2") not in spot  # no emulated twin


def test_reading_says_what_holds(report):
    text = (report / "README.md").read_text()
    reading = section(text, "Reading")
    assert "**SyncBN is flat across device counts** — holds" in reading
    assert "shrinks** — holds: significantly worse than at 64" in reading
    assert "from **8 images per device** down" in reading
    assert "**Batch Renormalization recovers part of BN's loss wherever BN loses** (at 8, 4, " in (
        reading
    )
    assert "rises at every halving of the per-device batch** — holds" in reading
    assert "**Test error follows the normalisation batch**" in reading
    anchors = section(text, "Anchors")
    assert "Wu & He 2018" in anchors and "Kosson et al. 2024" in anchors and "Ioffe 2017" in anchors
    rows = {r[0]: r for r in table_rows(anchors)}
    remedies = rows["Wu & He 2018, Section 5.1 (not checked against the paper)"]
    bn4 = statistics.fmean(planted_error("bn", s, 16) for s in SEEDS)
    gn = statistics.fmean(planted_error("gn", s, 1) for s in SEEDS)
    assert remedies[3] == f"at 4 images per device: bn {bn4:.2f} %, gn {gn:.2f} %"
    assert "lowest mean error at 64 images per device" not in anchors  # 64 is the reference
    for png in (
        "test_error_vs_per_device_batch.png",
        "test_error_vs_normalization_batch.png",
        "train_loss_curves.png",
    ):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{png}]({png})" in text


def test_an_effect_in_sync_is_reported_as_not_flat(sweep):
    for seed in SEEDS:  # sync at 64 devices 3 pp worse: not the same model any more
        path = sweep / "sweep" / f"sync_emulated64_s{seed}" / "summary.json"
        summary = json.loads(path.read_text())
        summary["test_acc"] -= 3.0
        path.write_text(json.dumps(summary))
    write_report(collect_runs(sweep / "sweep"), sweep / "out", "t")
    text = (sweep / "out" / "README.md").read_text()
    assert "**SyncBN is flat across device counts** — does not hold" in text


def test_no_runs_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no finished runs"):
        collect_runs(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        collect_runs(tmp_path / "missing")


def test_runs_without_the_normalisation_batch_are_refused_before_anything_is_written(sweep):
    path = sweep / "sweep" / "bn_emulated2_s0" / "summary.json"
    summary = json.loads(path.read_text())
    del summary["normalization_batch_size"]
    path.write_text(json.dumps(summary))
    with pytest.raises(UserError, match="1 run.* no normalization_batch_size"):
        write_report(collect_runs(sweep / "sweep"), sweep / "out", "t")
    assert not (sweep / "out").exists()


def fake_failure(root, bn, devices, seed, reason, finished_later=False, kind="failed"):
    """A run dir as syncbn_lab.multirun leaves a failed job (error.json with its cell)."""
    run_dir = root / f"{bn}_emulated{devices}_s{seed}_failed"
    run_dir.mkdir(parents=True)
    cell = dict(bn=bn, parallel="emulated", devices=devices, seed=seed)
    cell["per_device_batch_size"] = 64 // devices if 64 % devices == 0 else 64 / devices
    (run_dir / "error.json").write_text(json.dumps({"error": reason, "reason": kind, **cell}))
    if finished_later:  # a resumed sweep finished it: not a failure any more
        done = {**cell, "test_acc": 99.0, "steps": 9, "normalization_batch_size": 64 // devices}
        (run_dir / "summary.json").write_text(json.dumps(done))


def test_failed_runs_are_listed_and_their_cells_marked_missing(sweep):
    root = sweep / "sweep"
    for seed in SEEDS:  # every bn run at 2 images per device failed
        (root / f"bn_emulated32_s{seed}" / "summary.json").unlink()
        fake_failure(root, "bn", 32, seed, "rank 0 failed: RuntimeError: boom")
    fake_failure(root, "sync", 64, 4, "rank 1 failed: RuntimeError: boom")
    fake_failure(root, "bn", 3, 0, "trainer.global_batch_size=64 is not divisible | by 3")
    fake_failure(root, "bn", 4, 7, "fixed by the resume", finished_later=True)
    (root / "cut_short").mkdir()
    (root / "cut_short" / "summary.json").write_text('{"bn": "bn", "devices": 1')  # killed
    failures = collect_failures(root)
    assert len(failures) == 6 and "bn_emulated4_s7_failed" not in {f.run_dir.name for f in failures}
    runs = collect_runs(root)
    assert len(runs) == 4 * 19 - 4 + 1  # the resumed one counts, the cut-short one does not
    write_report(runs, sweep / "report", "Test report", failures=failures)
    text = (sweep / "report" / "README.md").read_text()
    assert "**6 run(s) failed**" in text
    assert (
        "| sync | emulated | 64 | 1 | 4 | rank 1 failed: RuntimeError: boom | "
        "sync_emulated64_s4_failed |" in text
    )
    assert "| bn | emulated | 3 | 21.3333 | 0 | trainer.global_batch_size=64 is not divisible " in (
        text
    )
    assert "\\| by 3 |" in text  # a | in the reason does not break the table
    table = {row[0]: row for row in table_rows(section(text, "Test error"))}
    assert table["2"][1:3] == ["– missing", "– missing"]  # bn (EMA, PreciseBN)
    assert table["1"][5].endswith("(1 missing)")  # sync (EMA): 4 of 5 seeds finished


def test_diverged_runs_are_marked_diverged_and_not_averaged(sweep):
    root = sweep / "sweep"
    for seed in SEEDS:
        (root / f"bn_emulated32_s{seed}" / "summary.json").unlink()
        fake_failure(root, "bn", 32, seed, "diverged at step 9: ...", kind="diverged")
    (root / "sync_emulated64_s3" / "summary.json").unlink()
    fake_failure(root, "sync", 64, 3, "diverged at step 3: ...", kind="diverged")
    write_report(collect_runs(root), sweep / "report", "Test", failures=collect_failures(root))
    table = {
        row[0]: row
        for row in table_rows(section((sweep / "report" / "README.md").read_text(), "Test error"))
    }
    assert table["2"][1:3] == ["– diverged", "– diverged"]
    assert table["1"][5].endswith("(1 diverged)") and not table["1"][5].startswith("–")


def test_machines_counts_each_cpu_in_words():
    from syncbn_lab.report.header import machines

    run = {"cpu_model": "AMD EPYC", "cpu_isa": "AVX2", "precision": "fp32"}
    other = {"cpu_model": "Intel Xeon", "cpu_isa": "AVX512", "precision": None}
    text = machines([run, run, other, {"cpu_model": None}])
    assert text == (
        "Machines: AMD EPYC (AVX2, fp32): 2 runs; "
        "Intel Xeon (AVX512, precision not recorded): 1 run."
    )
