"""Training numerics are bitwise those of BASE, the commit before the house was restructured
(run dir decisions, RunShape, the RNG and log-record helpers): one short run per parallel
mode, float32 and float64, the same logged losses, test loss and final parameters to the bit.
The reference is BASE's own source, exported from git and run on this machine beside the
working tree's (its C++ extension is the same source: csrc must not differ)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = "c100dfe"
PROBE = Path(__file__).with_name("bitwise_probe.py")

pytestmark = pytest.mark.slow


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def fingerprints(src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_training_is_bitwise_the_base_commits(tmp_path):
    if _git("cat-file", "-e", f"{BASE}^{{commit}}").returncode != 0:
        pytest.skip(f"{BASE} is not in this clone's history (a shallow clone)")
    if _git("diff", "--quiet", BASE, "--", "csrc", ":!csrc/*.md").returncode != 0:
        pytest.skip(f"csrc differs from {BASE}: its kernels would need a build of their own")
    archive = subprocess.run(
        ["git", "archive", BASE, "src", "configs"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    for built in (ROOT / "src" / "syncbn_lab").glob("_C*.so"):
        shutil.copy(built, tmp_path / "src" / "syncbn_lab" / built.name)
    base, now = fingerprints(tmp_path / "src"), fingerprints(ROOT / "src")
    assert sorted(base) == sorted(now) and len(now) == 8
    for case in now:
        assert now[case] == base[case], case
        assert all(loss is None or loss == loss for loss in now[case]["losses"])
