"""syncbn_lab.archive: a sweep's finished runs as one file to commit, laid out again on a
fresh checkout. The sweep-level behaviour (--archive, --resume <archive>) is in
test_sweep_smoke.py."""

import json
import tarfile

import pytest

from syncbn_lab import archive
from syncbn_lab.errors import UserError


def make_sweep(root, finished=("0_bn_emulated1_s0", "1_bn_emulated8_s0")):
    sweep_dir = root / "2026-12-05_18-00-00"
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "nbs_256", "parts": []}))
    (sweep_dir / "wall_time_s").write_text("12.0\n")
    for name in finished:
        run = sweep_dir / name
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"test_acc": 90.0, "steps": 10}))
        for extra in ("config.yaml", "metrics.jsonl", "train.log"):
            (run / extra).write_text(f"{name} {extra}\n")
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.pt").write_bytes(b"big")  # not archived
    cut = sweep_dir / "2_bn_emulated32_s0"  # still training when the session ended
    cut.mkdir()
    (cut / "summary.json").write_text(json.dumps({"steps": None}))
    (cut / "metrics.jsonl").write_text("{}\n")
    failed = sweep_dir / "3_bn_emulated128_s0"
    failed.mkdir()
    (failed / "error.json").write_text(json.dumps({"error": "boom"}))
    return sweep_dir


def names(path):
    with tarfile.open(path) as tar:
        return sorted(m.name for m in tar.getmembers())


def test_pack_holds_the_finished_runs_only_and_is_the_same_bytes_twice(tmp_path):
    sweep_dir = make_sweep(tmp_path / "multirun")
    packed = tmp_path / "reports" / "runs.tar.gz"
    assert archive.pack(sweep_dir, packed) == 2
    top = sweep_dir.name
    runs = [f"{top}/{r}/{f}" for r in ("0_bn_emulated1_s0", "1_bn_emulated8_s0")
            for f in ("config.yaml", "metrics.jsonl", "summary.json", "train.log")]  # fmt: skip
    assert names(packed) == sorted([*runs, f"{top}/sweep.json", f"{top}/wall_time_s"])
    first = packed.read_bytes()
    archive.pack(sweep_dir, packed)
    assert packed.read_bytes() == first  # nothing new finished: no change to commit
    (sweep_dir / "2_bn_emulated32_s0" / "summary.json").write_text(
        json.dumps({"test_acc": 91.0, "steps": 10})
    )
    assert archive.pack(sweep_dir, packed) == 3 and packed.read_bytes() != first
    assert not list(packed.parent.glob("*.tmp"))


def test_unpack_lays_out_the_sweep_dir_and_keeps_what_is_there(tmp_path):
    sweep_dir = make_sweep(tmp_path / "here")
    packed = tmp_path / "runs.tar.gz"
    archive.pack(sweep_dir, packed)
    top, record = archive.read_record(packed)
    assert top == sweep_dir.name and record["name"] == "nbs_256"
    fresh = archive.unpack(packed, tmp_path / "fresh")
    assert fresh == tmp_path / "fresh" / sweep_dir.name
    assert archive.finished_runs(fresh) == [
        fresh / "0_bn_emulated1_s0",
        fresh / "1_bn_emulated8_s0",
    ]
    run = fresh / "0_bn_emulated1_s0" / "train.log"
    assert run.read_text() == "0_bn_emulated1_s0 train.log\n"
    run.write_text("newer\n")  # a run finished here after the archive was written stays
    archive.unpack(packed, tmp_path / "fresh")
    assert run.read_text() == "newer\n"


def test_a_file_that_is_not_a_sweeps_archive_is_one_line(tmp_path):
    bogus = tmp_path / "runs.tar.gz"
    bogus.write_bytes(b"not a tarball")
    with pytest.raises(UserError, match="is not a sweep's archive"):
        archive.read_record(bogus)
    with tarfile.open(bogus, "w:gz") as tar:
        tar.add(tmp_path, arcname="a/b", recursive=False)
    with pytest.raises(UserError, match="is not a sweep's archive"):
        archive.read_record(bogus)  # no sweep.json


def test_attempts_record_each_start_and_its_time(tmp_path):
    first = archive.start_attempt(tmp_path, {"cpu_isa": "AVX512"})
    archive.end_of_attempt(tmp_path, first, 100.04, 3)
    second = archive.start_attempt(tmp_path, {"cpu_isa": "AVX2"})
    archive.end_of_attempt(tmp_path, second, 50.0, 2)
    attempts = archive.read_attempts(tmp_path)
    assert [(a["machine"]["cpu_isa"], a["wall_time_s"], a["runs_ended"]) for a in attempts] == [
        ("AVX512", 100.0, 3),
        ("AVX2", 50.0, 2),
    ]
