"""SLURM for real: a one-node cluster on 127.0.0.1 (scripts/slurm_local.sh), Hydra's submitit
launcher submitting this project's runs to it, failures on the cluster, scancel, and the
multi-node sbatch script (scripts/slurm_torchrun.sbatch) with one node.

`make test-cluster` runs these (pytest -m cluster); the cluster is started for the module
and stopped after it, unless it was already up. Where it cannot run (no root to install or
start it), every test skips with the script's one-line reason.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, TINY

from syncbn_lab.config import PRECISIONS
from syncbn_lab.parallel.gloo_jobs import free_port, load_function

pytestmark = pytest.mark.cluster

SCRIPT = str(ROOT / "scripts" / "slurm_local.sh")
SBATCH_SCRIPT = str(ROOT / "scripts" / "slurm_torchrun.sbatch")
TRAIN = str(ROOT / "scripts" / "train.py")
HELPERS = str(ROOT / "tests" / "parallel" / "parallel_helpers.py")
step_losses = load_function(f"{HELPERS}:step_losses")
processes_with_env = load_function(f"{HELPERS}:processes_with_env")
# The local node has 2 cores, no GPU and ~24 GB: each job asks for one core and 2 GB.
LAUNCHER = [
    "hydra/launcher=submitit_slurm",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=2",
    "hydra.launcher.timeout_min=10",
]
PRECISION, RTOL = ("fp64", 1e-9) if "fp64" in PRECISIONS else ("fp32", 1e-5)  # see below
# DDP and the emulation sum the same numbers in another order: ~1e-15 apart in float64;
# in float32, 1e-5 relative is the floor the emulation proof measured over 20 steps.
RUN = [*TINY, "trainer.max_steps=3", "trainer.threads=1", f"trainer.precision={PRECISION}"]


@pytest.fixture(scope="module")
def slurm_env():
    """The environment that reaches the local cluster (SLURM_CONF); starts and stops it."""
    state = os.environ.get("SYNCBN_LAB_SLURM_DIR", "/tmp/syncbn-lab-slurm")
    already_up = subprocess.run([SCRIPT, "status"], capture_output=True).returncode == 0
    if not already_up:
        up = subprocess.run([SCRIPT, "up"], capture_output=True, text=True, timeout=600)
        if up.returncode == 3:
            pytest.skip(up.stderr.strip().splitlines()[-1])
        assert up.returncode == 0, up.stderr
    env = {**os.environ, "SLURM_CONF": f"{state}/slurm.conf", "OMP_NUM_THREADS": "1"}
    try:
        yield env
    finally:
        if not already_up:
            subprocess.run([SCRIPT, "down"], capture_output=True, timeout=120)


def multirun(env, sweep_dir: Path, *overrides: str, timeout: int = 300):
    return subprocess.run(
        [sys.executable, TRAIN, "-m", *LAUNCHER, *RUN, f"hydra.sweep.dir={sweep_dir}", *overrides],
        env=env,
        cwd=sweep_dir.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ran_under_slurm(sweep_dir: Path) -> list[str]:
    """The job ids submitit's logs name (one folder per job of the array)."""
    logs = sorted((sweep_dir / ".submitit").glob("*/*_log.out"))
    return [log.parent.name for log in logs if "JobEnvironment(job_id=" in log.read_text()]


def test_a_multirun_runs_as_slurm_jobs_with_the_outputs_of_local_runs(slurm_env, tmp_path):
    sweep_dir = tmp_path / "sweep"
    overrides = ["bn=sync", "parallel=emulated,ddp", "parallel.devices=2"]
    result = multirun(slurm_env, sweep_dir, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(ran_under_slurm(sweep_dir)) == 2, result.stderr[-3000:]
    emulated, ddp = sweep_dir / "0_sync_emulated2_s0", sweep_dir / "1_sync_ddp2_s0"
    for run_dir in (emulated, ddp):
        assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints"} <= {
            p.name for p in run_dir.iterdir()
        }
        assert (run_dir / "checkpoints" / "last.pt").stat().st_size > 0
        log = (run_dir / "train.log").read_text()  # the job's terminal lines, as a local run's
        assert "epoch 1 | step 3 |" in log and "-- run finished" in log, log
    assert json.loads((ddp / "summary.json").read_text())["parallel"] == "ddp"

    # the same job run locally writes the same files and the same losses
    local = tmp_path / "local"
    command = [sys.executable, TRAIN, *RUN, "bn=sync", "parallel=emulated", "parallel.devices=2"]
    done = subprocess.run(
        [*command, f"hydra.run.dir={local}"], env=slurm_env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert {p.name for p in local.iterdir()} == {p.name for p in emulated.iterdir()}
    assert step_losses(emulated) == step_losses(local)
    # 2 spawned gloo ranks inside the SLURM job compute what the emulation of 2 devices does
    for a, b in zip(step_losses(ddp), step_losses(emulated), strict=True):
        assert abs(a - b) <= RTOL * abs(b), (a, b)


def test_failed_jobs_on_the_cluster_are_reported_and_the_others_finish(slurm_env, tmp_path):
    sweep_dir = tmp_path / "sweep"
    try:
        from syncbn_lab.faults import fault_override
    except ImportError:
        pytest.skip("syncbn_lab.faults has no fault_override (rank-failure injection)")
    # devices=3 does not divide the global batch of 32 (a bad override); under DDP rank 1
    # raises at step 2 (the emulated jobs have no rank 1)
    fault = fault_override("raise", rank=1, step=2)
    result = multirun(slurm_env, sweep_dir, "parallel=emulated,ddp", "parallel.devices=2,3", fault)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: job ")]
    bad_batch = (
        "trainer.global_batch_size=32 is not divisible by parallel.devices x "
        "trainer.accumulate = 3 x 1; pick a global batch that is a multiple of their product"
    )
    assert lines == [
        f"error: job 1_bn_emulated3_s0 failed: {bad_batch}",
        "error: job 2_bn_ddp2_s0 failed: rank 1 failed: RuntimeError: injected fault on rank 1 "
        "at step 2",
        f"error: job 3_bn_ddp3_s0 failed: {bad_batch}",
    ], result.stderr[-3000:]
    assert (sweep_dir / "0_bn_emulated2_s0" / "summary.json").exists()
    assert len(ran_under_slurm(sweep_dir)) == 4

    report = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py"), str(sweep_dir), "--out", str(report)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    text = (report / "README.md").read_text()
    assert "**3 run(s) failed**" in text
    assert "| rank 1 failed: RuntimeError: injected fault on rank 1 at step 2 | 2_bn_ddp2_s0 |" in (
        text
    )


def test_the_smoke_sweep_runs_through_slurm(slurm_env, tmp_path):
    sweep_dir, report_dir = tmp_path / "sweep", tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "sweep.py"),
            "--smoke",
            "--launcher",
            "slurm",
            "--sweep-dir",
            str(sweep_dir),
            "--report-dir",
            str(report_dir),
            *LAUNCHER[1:],
        ],
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=420,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # the grid (bn, sync x 1, 4 devices), brn at 4, GroupNorm, and one 2-rank DDP run
    assert len(ran_under_slurm(sweep_dir)) == 7
    lines = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == [f"[{k}/7" for k in range(1, 8)], lines
    assert lines[-1].endswith("| all runs done") and "epoch " not in result.stdout
    rows = list(csv.DictReader(open(report_dir / "results.csv")))
    assert sorted((r["bn"], r["parallel"], r["devices"]) for r in rows) == [
        ("bn", "emulated", "1"),
        ("bn", "emulated", "4"),
        ("brn", "emulated", "4"),
        ("gn", "emulated", "1"),
        ("sync", "ddp", "2"),
        ("sync", "emulated", "1"),
        ("sync", "emulated", "4"),
    ]
    assert "| 16 |" in (report_dir / "README.md").read_text()


def sbatch(env, tmp_path, run_dir, *overrides, wait=True, marker=""):
    exports = {
        "RUN_DIR": str(run_dir),
        "RDZV_PORT": str(free_port()),
        "PYTHON": sys.executable,
        "NPROC_PER_NODE": "2",
        "SYNCBN_LAB_TEST_MARKER": marker,
    }
    return subprocess.run(
        [
            "sbatch",
            "--parsable",
            *(["--wait"] if wait else []),
            f"--output={tmp_path}/slurm-%j.out",
            SBATCH_SCRIPT,
            *overrides,
        ],
        env={**env, **exports},
        cwd=ROOT,  # sbatch from the repository, as the script's header says
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_multinode_sbatch_script_on_one_node(slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    result = sbatch(slurm_env, tmp_path, run_dir, *RUN, "parallel=ddp", "bn=sync")
    out = "".join(p.read_text()[-3000:] for p in tmp_path.glob("slurm-*.out"))
    assert result.returncode == 0, result.stderr + out
    assert (run_dir / "summary.json").exists(), out
    emulated = tmp_path / "emulated"
    command = [sys.executable, TRAIN, *RUN, "bn=sync", "parallel=emulated", "parallel.devices=2"]
    done = subprocess.run(
        [*command, f"hydra.run.dir={emulated}"], env=slurm_env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for a, b in zip(step_losses(run_dir), step_losses(emulated), strict=True):
        assert abs(a - b) <= RTOL * abs(b), (a, b)


def in_queue(env, job_id: str) -> bool:
    queue = subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True)
    return bool(queue.stdout.strip())


def test_scancel_leaves_no_process_on_the_node(slurm_env, tmp_path):
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    long_run = [*TINY, "parallel=ddp", "trainer.epochs=1000", "trainer.max_steps=100000"]
    submitted = sbatch(slurm_env, tmp_path, run_dir, *long_run, wait=False, marker=marker)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, "the job never started training"
            time.sleep(0.5)
        running = processes_with_env(marker)
        assert len(running) >= 3, running  # torchrun and its two ranks at least
        subprocess.run(["scancel", job_id], env=slurm_env, check=True)
        deadline = time.monotonic() + 60
        while processes_with_env(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_with_env(marker) == []
        while in_queue(slurm_env, job_id) and time.monotonic() < deadline:
            time.sleep(0.5)  # completing (CG) until slurmd has seen every process end
        assert not in_queue(slurm_env, job_id)
    finally:
        for pid in processes_with_env(marker):
            os.kill(pid, signal.SIGKILL)


def test_a_job_cancelled_on_the_cluster_is_a_failed_job_of_the_multirun(slurm_env, tmp_path):
    sweep_dir = tmp_path / "sweep"
    marker = uuid.uuid4().hex
    command = [sys.executable, TRAIN, "-m", *LAUNCHER, *TINY, f"hydra.sweep.dir={sweep_dir}"]
    command += ["trainer.epochs=100000", "trainer.max_steps=3,10000000"]  # job 1 runs on
    log = open(tmp_path / "multirun.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        command,
        env={**slurm_env, "SYNCBN_LAB_TEST_MARKER": marker},
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        metrics = sweep_dir / "1_bn_single1_s0" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, "job 1 never trained"
            time.sleep(0.5)
        queue = subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True, text=True
        )
        job_id = next(j for j in queue.stdout.split() if j.endswith("_1"))
        subprocess.run(["scancel", job_id], env=slurm_env, check=True)
        code = proc.wait(timeout=180)  # submitit sees CANCELLED in sacct, then the rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    out = (tmp_path / "multirun.log").read_text()
    assert code == 1, out[-3000:]
    failed = [line for line in out.splitlines() if line.startswith("error: job ")]
    assert len(failed) == 1 and failed[0].startswith(
        f"error: job 1_bn_single1_s0 failed: SLURM job {job_id} ended without a result (CANCELLED"
    ), out[-3000:]
    assert (sweep_dir / "0_bn_single1_s0" / "summary.json").exists()
    assert json.loads((sweep_dir / "1_bn_single1_s0" / "error.json").read_text())["seed"] == 0
    assert processes_with_env(marker) == []


def test_a_requeued_job_resumes_from_its_checkpoint_and_ends_bitwise_equal(slurm_env, tmp_path):
    """`scontrol requeue` at step 31 of 80: SLURM stops the job with SIGTERM, the run saves a
    checkpoint at the next step and exits without a result, SLURM runs the job again, and the
    job continues from the checkpoint in its own run dir. Its final parameters equal those of
    the same run uninterrupted (fp32, one thread), bitwise."""
    import torch

    from syncbn_lab.engine import checkpoint
    from syncbn_lab.faults import fault_override

    long = [*TINY, "trainer.epochs=10", "trainer.threads=1", "trainer.precision=fp32"]
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "-m", *LAUNCHER, *long, fault_override("requeue", 0, 31),
         f"hydra.sweep.dir={sweep_dir}"],
        env=slurm_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # SLURM holds a requeued job for about two minutes; once the first attempt has left its
    # error.json (stopped at a step), let it start at once.
    deadline = time.monotonic() + 300
    while not list(sweep_dir.glob("*/error.json")) and time.monotonic() < deadline:
        time.sleep(0.5)
    (job_id,) = {p.name for p in sweep_dir.glob(".submitit/*") if p.name.isdigit()}
    while time.monotonic() < deadline:
        state = ["squeue", "-h", "-j", job_id, "-o", "%T"]
        if "PENDING" in subprocess.run(state, env=slurm_env, capture_output=True, text=True).stdout:
            update = ["scontrol", "update", f"JobId={job_id}", "StartTime=now"]
            subprocess.run(update, env=slurm_env, capture_output=True)
            break
        time.sleep(0.5)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    run_dir = next(p for p in sweep_dir.iterdir() if (p / "summary.json").exists())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 80 and summary["resumed_from"] == str(run_dir)
    log = (run_dir / "train.log").read_text()
    assert "stopped by SIGTERM at step 3" in log and "resuming: " in log, log[-3000:]

    local = tmp_path / "local"
    done = subprocess.run(
        [sys.executable, TRAIN, *long, f"hydra.run.dir={local}"],
        env=slurm_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    a = checkpoint.load(local / "checkpoints" / "last.pt")["model"]
    b = checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
