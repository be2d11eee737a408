"""The normalisation-batch study's report (report/nbs.py, scripts/report.py on a sweep of
experiment=nbs_256): cells and comparisons as the experiment declares them and the sweep
declared its runs, unfinished ones marked; the U-shape claim from a quadratic fit with seeds
as blocks, set against curves written out by hand; SyncBN groups against BN at the same
normalisation batch."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT

from syncbn_lab import archive, sweep
from syncbn_lab.report import load, nbs
from syncbn_lab.report.cells import Cell
from syncbn_lab.report.stats import Paired
from syncbn_lab.report.verdicts import reaches

SEED_SHIFT = (0.00, 0.30, -0.20, 0.10)  # each seed's own offset, the same in every cell
JITTER = (0.04, -0.03, 0.02, -0.05)  # per seed, alternating with the cell: residual noise
# bn cells of nbs_256 by devices -> normalisation batch 256 / devices
BN = {1: 256, 8: 32, 32: 8, 128: 2}
KEYS = ("normalization_batch_size", "bn", "devices")  # nbs_256's sweep.report.cells


def summary(bn, devices, nbs, seed, error, loss=0.1):
    return {
        "bn": bn, "devices": devices, "normalization_batch_size": nbs, "seed": seed,
        "global_batch_size": 256, "per_device_batch_size": 256 // devices, "steps": 3120,
        "test_acc": 100 - error, "test_acc_precise_bn": 100 - error - 0.05,
        "test_acc_batch_stats": 100 - error - 0.5, "train_loss": loss,
        "wall_time_s": 700.0, "train_time_s": 640.0, "time_validation_s": 40.0,
        "time_test_s": 5.0, "time_precise_bn_s": 6.0, "time_test_batch_stats_s": 4.0,
        "time_checkpoints_s": 0.1, "time_logging_s": 0.1, "cpu_model": "AMD EPYC",
        "cpu_isa": "AVX512", "precision": "fp32", "training_code": "abc123def456",
        "git_commit": "0123456789abcdef", "parallel": "emulated",
    }  # fmt: skip


def make_sweep(tmp_path, bn_error, sync_error=None, skip=()):
    """A sweep dir of experiment=nbs_256 as sweep.py lays it out, with finished runs whose
    test error is ``bn_error[nbs]`` (+ the seed's shift and jitter); ``skip``: (devices,
    seed) of bn runs not finished."""
    sweep_dir = tmp_path / "2026-12-05_19-00-00"
    sweep_dir.mkdir(parents=True)
    parts = sweep.plan("nbs_256", False, "emulated", "joblib", [])
    record = {"name": "nbs_256", "experiment": "nbs_256", "parts": parts}
    (sweep_dir / "sweep.json").write_text(json.dumps(record))
    cells = [("bn", d, BN[d], bn_error[BN[d]]) for d in BN]
    if sync_error is not None:
        cells.append(("sync", 128, 32, sync_error))
    k = 0
    for bn, devices, batch, error in cells:
        for seed in range(4):
            if (devices, seed) in skip and bn == "bn":
                continue
            run = sweep_dir / f"{k}_{bn}_emulated{devices}_s{seed}"
            run.mkdir()
            k += 1
            e = error + SEED_SHIFT[seed] + JITTER[(seed + len(bn) * devices) % 4]
            loss = 0.05 + 0.01 * math.log2(256 / batch)  # smaller batches fit less
            (run / "summary.json").write_text(
                json.dumps(summary(bn, devices, batch, seed, e, loss))
            )
            curve = [(98 * i, min(80 + 2.5 * i - 0.01 * (256 / batch), 93)) for i in range(1, 9)]
            (run / "metrics.jsonl").write_text(
                "".join(json.dumps({"step": s, "val/acc": a}) + "\n" for s, a in curve)
            )
    return sweep_dir


def cell(batch, variant, devices):
    return Cell((batch, variant, devices), KEYS)


def loaded(sweep_dir):
    return load([sweep_dir], sweep_dir.parent, "c")


def study(sweep_dir):
    return nbs.NormalizationBatchStudy(loaded(sweep_dir).cells(), 0.18)


def test_the_declared_cells_are_the_experiments_grid_and_its_sync_groups(tmp_path):
    s = study(make_sweep(tmp_path, dict.fromkeys(BN.values(), 7.0)))
    expected = {cell(b, "bn", d): [0, 1, 2, 3] for d, b in BN.items()}
    expected[cell(32, "sync", 128)] = [0, 1, 2, 3]  # groups of 16 of 128 devices
    assert s.cells.declared == expected
    assert s.label(cell(32, "sync", 128)) == "sync in groups of 16, 128 devices"
    assert s.whole == cell(256, "bn", 1)
    assert [a for a, _ in s.below_whole] == [cell(2, "bn", 128), cell(8, "bn", 32),
                                              cell(32, "bn", 8)]  # fmt: skip
    assert s.groups == [(cell(32, "sync", 128), cell(32, "bn", 8), cell(2, "bn", 128))]


def test_quadratic_vertex_recovers_a_known_parabola():
    """error = seed + 0.1 (x - 4)^2 exactly (x = log2 batch 1..8): minimum at x = 4,
    c = 0.1, and with tiny noise the interval is tight around it."""
    points = [(s, x, SEED_SHIFT[s] + 0.1 * (x - 4) ** 2 + 1e-3 * JITTER[s] * (-1) ** x)
              for s in range(4) for x in (1, 3, 5, 8)]  # fmt: skip
    v = nbs.quadratic_vertex(points)
    assert math.isclose(v.c, 0.1, rel_tol=1e-2) and math.isclose(v.at, 4.0, abs_tol=0.05)
    assert v.low < 4 < v.high and v.high - v.low < 0.2 and v.c_p < 1e-6
    assert v.df == 16 - 6  # 4 seed intercepts, b and c
    # the fit at the vertex against the fit at the largest x: 0 - 0.1 (8 - 4)^2
    assert math.isclose(v.depth, -1.6, abs_tol=0.01) and 0 < v.depth_half < 0.01
    assert nbs.floor_below_whole(v) == "resolved"
    shallow = dataclasses.replace(v, depth=-0.25, depth_half=0.27)  # its interval holds 0
    assert nbs.floor_below_whole(shallow) == "not resolved"


@pytest.mark.parametrize(
    "errors, verdict",
    [
        ({256: 7.6, 32: 7.0, 8: 7.2, 2: 7.9}, "holds"),  # a U with its floor near 32
        ({256: 7.0, 32: 7.3, 8: 7.6, 2: 8.0}, "does not hold"),  # monotone: the whole batch wins
        ({256: 8.0, 32: 7.6, 8: 7.3, 2: 7.0}, "does not hold"),  # monotone the other way
    ],
)
def test_a_u_needs_an_interior_minimum_whose_interval_excludes_both_ends(tmp_path, errors, verdict):
    found, _ = nbs.u_shape(study(make_sweep(tmp_path, errors)))
    assert found == verdict


def test_unfinished_cells_are_marked_and_claims_wait_for_them(tmp_path):
    errors = {256: 7.6, 32: 7.0, 8: 7.2, 2: 7.9}
    sweep_dir = make_sweep(tmp_path, errors, sync_error=None, skip={(128, 2), (128, 3)})
    source = loaded(sweep_dir)
    s = nbs.NormalizationBatchStudy(source.cells(), 0.18)
    assert nbs.u_shape(s)[0] == "not yet"
    text = nbs.markdown(source, s)
    assert "14 of 20 declared runs finished; 6 not yet (0 failed)." in text
    assert "| 2 | bn, 128 devices | 2/4 |" in text
    assert "| 32 | sync in groups of 16, 128 devices | 0/4 | – |" in text
    assert "**A U in the normalisation batch: not yet.** The bn cells are not all finished." in text
    assert "sync in groups of 16, 128 devices: **not yet**" in text


def test_groups_that_match_bn_at_the_same_normalisation_batch_hold(tmp_path):
    errors = {256: 7.6, 32: 7.0, 8: 7.2, 2: 7.9}
    source = loaded(make_sweep(tmp_path, errors, sync_error=7.02))
    s = nbs.NormalizationBatchStudy(source.cells(), 0.18)
    d = s.cells.against(cell(32, "sync", 128), cell(32, "bn", 8))
    assert d.n == 4 and math.isclose(d.mean, 0.02, abs_tol=0.05)
    assert "sync in groups of 16, 128 devices: **holds**" in nbs.markdown(source, s)
    against_128 = s.cells.against(cell(32, "sync", 128), cell(2, "bn", 128))
    assert against_128.significant and against_128.mean < -0.8  # the remedy at 128 devices
    far = loaded(make_sweep(tmp_path / "far", errors, sync_error=7.8))
    text = nbs.markdown(far, nbs.NormalizationBatchStudy(far.cells(), 0.18))
    assert "sync in groups of 16, 128 devices: **does not hold**" in text
    near = Paired(0.4, 0.5, 4, 0.2)  # beyond the noise, not resolved by 4 seeds
    assert reaches(near, 0.25) == "undecided (more seeds)"
    assert reaches(Paired(0.1, 0.01, 4, 0.001), 0.25) == "holds"  # tiny, consistent
    assert reaches(Paired(-1.0, 0.53, 4, 0.03), 0.25) == "holds, and beats it"  # below, resolved
    assert reaches(Paired(1.0, 0.53, 4, 0.03), 0.25) == "does not hold"


def test_mde_follows_the_t_table():
    # t(0.975, 3) = 3.182 and t(0.8, 3) = 0.978 from a t-table: (3.182 + 0.978) / 2 = 2.080
    assert math.isclose(nbs.mde(1.0, 4), 2.080, abs_tol=2e-3)
    assert math.isclose(nbs.mde(1.0, 10_000), (1.960 + 0.842) / 100, rel_tol=1e-2)


def test_report_script_renders_from_the_archive_with_its_time_and_machines(tmp_path):
    """scripts/report.py on a runs.tar.gz: read from a temporary copy (nothing written under
    the checkout's multirun/), the nbs report chosen by the experiment's sweep.report, the code
    version, machines and time outside training stated."""
    errors = {256: 7.6, 32: 7.0, 8: 7.2, 2: 7.9}
    sweep_dir = make_sweep(tmp_path, errors, sync_error=7.02)
    archive.start_attempt(sweep_dir, {"cpu": "AMD EPYC", "cpu_isa": "AVX512"})
    packed = tmp_path / "runs.tar.gz"
    archive.pack(sweep_dir, packed)
    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py"), str(packed), "--out", str(out),
         "--wall-time-s", "5400"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (ROOT / "multirun" / "nbs_256" / sweep_dir.name).exists()
    text = (out / "README.md").read_text()
    assert text.startswith("# The normalisation batch")
    assert "20 of 20 declared runs finished." in text
    assert "One training code (`training_code` abc123def456; commits 0123456)." in text
    assert "Machines: AMD EPYC (AVX512, fp32): 20 runs." in text
    assert "The sweep took 90.0 min of wall time in 1 attempt(s)." in text
    # (700 - 640) / 700 of each run outside the steps; validation 40 / 700
    assert "8.6 % is outside the training steps: validation 5.7 %," in text
    assert f"![test error against the normalisation batch]({nbs.PLOT})" in text
    assert (out / nbs.PLOT).stat().st_size > 10_000
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 21 and rows[0].startswith("bn,devices,normalization_batch_size")
