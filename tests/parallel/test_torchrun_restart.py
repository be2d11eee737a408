"""torchrun --max-restarts: a rank killed mid-run costs a restart, not the job. torchrun
restarts both ranks, they continue from the run dir's last checkpoint in the same run dir,
and the finished run is bitwise the uninterrupted one; with no checkpoint yet the restart
starts from step 0; a rank 0 that refuses its run dir stops every rank with one line."""

import json
import os
import subprocess
import uuid

import pytest
import torch
from conftest import ROOT, TINY

from syncbn_lab.engine import checkpoint

TORCHRUN = ROOT / ".venv" / "bin" / "torchrun"
TRAIN = str(ROOT / "scripts" / "train.py")
# 256 images, 32 a step: 8 steps an epoch, 16 steps in all; a checkpoint every 2 steps.
RUN = [*TINY, "parallel=ddp", "parallel.devices=2", "trainer.epochs=2", "trainer.threads=1"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed in .venv"),
]


def torchrun(tmp_path, run_dir, *overrides, restarts=1):
    """``torchrun --standalone --nproc_per_node=2`` of train.py; its output (both ranks and
    torchrun's own lines) captured."""
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*command, TRAIN, *RUN, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def kill(rank, step):
    return (
        f"trainer.callbacks=[{{_target_:syncbn_lab.faults.Fault,action:kill,rank:{rank},"
        f"step:{step}}}]"
    )


def no_traceback_of_ours(output):
    """Every traceback in the output is torchrun's own report of a failed job."""
    return output.count("Traceback") == output.count("errors.ChildFailedError: ")


def ours(output):
    """The lines our processes print (not torchrun's own W/E log lines)."""
    return [
        line for line in output.splitlines() if line.startswith(("error:", "resuming:", "restart:"))
    ]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("whole")
    done = torchrun(tmp_path, tmp_path / "run", "trainer.checkpoint_every=2", restarts=0)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "run"


def assert_same_end(a, b):
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for key in ("test_loss", "test_acc", "train_loss", "steps", "best_val_acc"):
        assert sa[key] == sb[key], key
    pa, pb = (checkpoint.load(d / "checkpoints" / "last.pt")["model"] for d in (a, b))
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key

    def steps(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in rows]

    assert steps(a) == steps(b)  # each record once: those after the checkpoint were dropped


def test_a_rank_killed_at_step_5_is_restarted_and_the_run_ends_bitwise_uninterrupted(
    tmp_path, whole
):
    run_dir = tmp_path / "run"
    done = torchrun(tmp_path, run_dir, "trainer.checkpoint_every=2", kill(1, 5))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert no_traceback_of_ours(output), output[-3000:]
    lines = ours(output)
    assert len(lines) == 2 and lines[0].startswith("error: rank 0 stopped"), lines
    assert lines[1] == f"resuming: {run_dir} from its last checkpoint"
    assert json.loads((run_dir / "elastic.json").read_text())["run_id"]
    assert_same_end(whole, run_dir)


def test_a_restart_before_the_first_checkpoint_starts_from_step_0(tmp_path, whole):
    run_dir = tmp_path / "run"
    # checkpoints at epoch ends only: the kill at step 3 comes before the first
    done = torchrun(tmp_path, run_dir, "trainer.checkpoint_every=null", kill(0, 3))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert no_traceback_of_ours(output), output[-3000:]
    assert f"restart: {run_dir} holds no checkpoint yet; the run starts again" in ours(output)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_loss"] == json.loads((whole / "summary.json").read_text())["test_loss"]


def test_a_run_dir_rank_0_refuses_stops_every_rank_with_one_line(tmp_path, whole):
    """A new job (restart count 0) into a run dir that holds a run: rank 0 refuses it, and
    rank 1, waiting for the group, stops with one line too (no traceback, no time-out)."""
    done = torchrun(tmp_path, whole, f"trainer.seed={uuid.uuid4().int % 7 + 1}", restarts=0)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and no_traceback_of_ours(output), output[-3000:]
    lines = ours(output)  # rank 0 says why first; each line whole (torchrun ends the others)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"error: {whole} already holds a run"), lines
    assert lines[1].startswith("error: rank 1 stopped: rank 0 refused the run"), lines
