"""provenance(): the commit and machine a benchmark's JSON names must be this checkout's."""

import os
import subprocess
from pathlib import Path

import torch

from syncbn_lab.provenance import git_commit, provenance

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def test_commit_and_dirty_flag_are_this_checkouts():
    head = _git("rev-parse", "HEAD")
    meta = provenance()
    assert meta["git_commit"] == git_commit() == head and len(head) == 40
    assert meta["git_dirty"] == bool(_git("status", "--porcelain", "--untracked-files=no"))


def test_machine_and_software_are_recorded():
    meta = provenance()
    assert meta["machine"]["cores"] == len(os.sched_getaffinity(0))
    assert meta["machine"]["cpu"] and meta["machine"]["memory_gib"] > 0
    assert meta["torch"] == torch.__version__
    assert meta["torch_threads"] == torch.get_num_threads()


def test_outside_a_checkout_the_commit_is_none(monkeypatch, tmp_path):
    import syncbn_lab.provenance as p

    monkeypatch.setattr(p, "_SOURCE", tmp_path)
    assert p.git_commit() is None and p.git_dirty() is None


def test_write_json_puts_provenance_beside_the_records(tmp_path):
    import json

    from syncbn_lab.provenance import write_json

    write_json(tmp_path / "bench.json", [{"ms": 1.5}], threads=1)
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["records"] == [{"ms": 1.5}]
    assert document["meta"]["threads"] == 1
    assert document["meta"]["git_commit"] == git_commit()


def test_each_cpu_capability_compiles_into_its_own_inductor_cache(tmp_path):
    # Inductor's cache key leaves the capability out; a graph compiled under another one
    # aborts the process (machine.isolate_inductor_cache)
    import os
    import subprocess
    import sys

    code = "import os, syncbn_lab; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    base = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for name in ("SYNCBN_LAB_INDUCTOR_CACHE_BASE", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        base.pop(name, None)  # the native run: also when the suite itself runs capped
    capped = {**base, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    dirs = []
    for env in (base, capped):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        dirs.append(done.stdout.strip())
    assert dirs[0] != dirs[1] and all(d.startswith(str(tmp_path) + os.sep) for d in dirs)
    assert dirs[1].endswith("avx2-onednn_avx2")
    inherited = {**capped, "TORCHINDUCTOR_CACHE_DIR": dirs[0]}  # a child of a native parent
    inherited["SYNCBN_LAB_INDUCTOR_CACHE_BASE"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", code], env=inherited, capture_output=True, text=True
    )
    assert done.stdout.strip() == dirs[1]


def test_training_code_hash_follows_the_training_path_only(tmp_path):
    """Runs with equal training_code trained with the same code: an edit on the training path
    changes the hash, one to the report or the sweep does not (they run after/around runs)."""
    from syncbn_lab.provenance import training_code

    for name in ("src/syncbn_lab/nn/bn.py", "src/syncbn_lab/report/plots.py",
                 "src/syncbn_lab/sweep.py", "configs/config.yaml", "scripts/train.py",
                 "scripts/report.py"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    first = training_code(tmp_path)
    assert len(first) == 12 and training_code(tmp_path) == first
    for untracked in ("src/syncbn_lab/report/plots.py", "src/syncbn_lab/sweep.py",
                      "scripts/report.py", "src/syncbn_lab/nn/notes.txt"):  # fmt: skip
        (tmp_path / untracked).write_text("x = 2\n")
        assert training_code(tmp_path) == first, untracked
    for tracked in ("src/syncbn_lab/nn/bn.py", "configs/config.yaml", "scripts/train.py"):
        before = training_code(tmp_path)
        (tmp_path / tracked).write_text((tmp_path / tracked).read_text() + "# edit\n")
        assert training_code(tmp_path) != before, tracked
    assert len(training_code()) == 12  # this checkout's
