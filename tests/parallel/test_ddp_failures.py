"""When a DDP rank raises, dies or hangs, the whole run ends: non-zero exit, the failing
rank's error reported once, no process left behind. Also: torchrun's ranks share one run dir."""

import os
import subprocess
import sys
import time
import uuid

import pytest
from conftest import ROOT, TINY, compose_config
from parallel_helpers import alive, processes_with_env

from syncbn_lab.errors import ConfigError
from syncbn_lab.faults import fault_override
from syncbn_lab.parallel.ddp import GRACE_S, RankFailed
from syncbn_lab.train import run

TRAIN = str(ROOT / "scripts" / "train.py")
DDP = [*TINY, "parallel=ddp", "parallel.devices=2", "trainer.max_steps=8"]


def no_process_left(marker: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while processes_with_env(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_rank_that_raises_ends_the_run_with_one_report(tmp_path):
    marker = f"SYNCBN_LAB_TEST_MARKER={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    fault = fault_override("raise", rank=1, step=3)
    result = subprocess.run(
        [sys.executable, TRAIN, *DDP, fault, f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    err = result.stderr
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 1 failed: RuntimeError: injected fault on rank 1 at step 3"], err
    assert err.count("Traceback (most recent call last)") == 1, err  # rank 1's, once
    assert "Connection closed" not in err and "Connection reset" not in err, err  # rank 0's
    assert not (tmp_path / "run" / "summary.json").exists()
    assert no_process_left(marker), processes_with_env(marker)
    log = (tmp_path / "run" / "train.log").read_text()  # the run's log holds the error too
    assert errors[0] in log.splitlines() and log.count("Traceback (most recent call last)") == 1


def test_a_killed_rank_ends_the_run(tmp_path):
    with pytest.raises(RankFailed) as failure:
        run(compose_config([*DDP, fault_override("kill", rank=1, step=3)]), tmp_path)
    assert failure.value.rank == 1
    assert (
        str(failure.value) == "rank 1 died (killed by signal SIGKILL); the other ranks were stopped"
    )
    assert not any(alive(pid) for pid in failure.value.pids)
    assert not (tmp_path / "summary.json").exists()


def test_a_hung_rank_ends_the_run_after_the_collective_timeout(tmp_path):
    timeout = 3
    hang = fault_override("hang", rank=1, step=2)
    started = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run(compose_config([*DDP, hang, f"parallel.timeout_s={timeout}"]), tmp_path)
    elapsed = time.monotonic() - started
    assert str(failure.value).startswith("rank(s) 1 stopped responding: rank 0's collective")
    assert not any(alive(pid) for pid in failure.value.pids)
    assert elapsed < timeout + GRACE_S + 15  # 15 s to start the ranks on a busy box


def test_a_user_error_inside_the_ranks_is_raised_once_as_itself(tmp_path):
    # 20 images over 2 devices x 2 micro-batches: 5 for each micro-batch of 8, no full step
    cfg = compose_config([*DDP, "data.num_train=20", "trainer.accumulate=2"])
    with pytest.raises(ConfigError, match="gives no full step"):
        run(cfg, tmp_path)


def test_impossible_combination_fails_before_any_process_starts(tmp_path):
    cfg = compose_config([*DDP, "trainer.global_batch_size=33"])
    with pytest.raises(ConfigError, match="not divisible"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_torchrun_ranks_write_one_run_dir(tmp_path):
    torchrun = ROOT / ".venv" / "bin" / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node=2",
            TRAIN,
            *TINY,
            "parallel=ddp",  # parallel.devices follows torchrun's WORLD_SIZE
            "trainer.max_steps=3",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "summary.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no second Hydra dir
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"val/acc"' not in line]) == 3  # rank 0 alone logged
    log = (run_dir / "train.log").read_text().splitlines()  # rank 0's terminal lines
    shown = [line for line in result.stdout.splitlines() if line.startswith(("epoch ", "-- run"))]
    assert len(shown) == 2 and all(line in log for line in shown), result.stdout
