"""scripts/retrain_check.py retrains a run of an archive and finds it identical; a record that
the old code logged differently is found and named."""

import gzip
import io
import json
import math
import subprocess
import sys
import tarfile

from conftest import ROOT, TINY, compose_config

from syncbn_lab import archive
from syncbn_lab.train import run

SCRIPT = ROOT / "scripts" / "retrain_check.py"


def check(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # fmt: skip


def test_a_run_retrained_by_the_same_code_is_identical_and_a_changed_record_is_found(tmp_path):
    sweep = tmp_path / "sweep"
    run(compose_config([*TINY, "trainer.max_steps=6", "trainer.threads=1"]), sweep / "0_tiny")
    (sweep / "sweep.json").write_text("{}\n")
    packed = tmp_path / "runs.tar.gz"
    assert archive.pack(sweep, packed) == 1
    same = check(packed, "0_tiny")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "identical" in same.stdout and "summary numbers, to the bit" in same.stdout

    # the same archive with one loss one ulp off, as a code that trains differently logs it
    with tarfile.open(packed) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member, data in members:
            if member.name.endswith("metrics.jsonl"):
                rows = [json.loads(line) for line in data.decode().splitlines()]
                rows[2]["train/loss"] = math.nextafter(rows[2]["train/loss"], math.inf)
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    changed = tmp_path / "changed.tar.gz"
    changed.write_bytes(gzip.compress(buffer.getvalue()))
    differs = check(changed, "0_tiny")
    assert differs.returncode == 1, differs.stdout + differs.stderr
    assert "metrics.jsonl step 3" in differs.stdout


def test_an_unknown_run_is_one_line(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}\n")
    packed = tmp_path / "runs.tar.gz"
    archive.pack(sweep, packed)
    result = check(packed, "nope")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "holds no finished run nope" in result.stderr


def test_two_run_dirs_compared_identical_and_one_ulp_apart(tmp_path):
    """--compare: two runs of one configuration, as two codes trained them on one machine."""
    import shutil

    first = tmp_path / "old"
    run(compose_config([*TINY, "trainer.max_steps=4", "trainer.threads=1"]), first)
    same = check("--compare", first, first)
    assert same.returncode == 0 and "identical" in same.stdout, same.stdout + same.stderr
    second = tmp_path / "new"
    shutil.copytree(first, second)
    rows = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    rows[1]["train/loss"] = math.nextafter(rows[1]["train/loss"], -math.inf)
    (second / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    differs = check("--compare", first, second)
    assert differs.returncode == 1 and "metrics.jsonl step 2" in differs.stdout, differs.stdout
    missing = check("--compare", first, tmp_path / "nowhere")
    assert missing.returncode == 2 and "is no finished run" in missing.stderr, missing.stderr
