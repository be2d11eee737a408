"""Multi-node torchrun on one host: two torchrun "nodes" of two ranks each, joined by the c10d
rendezvous on 127.0.0.1, train parallel=ddp bn=sync exactly as the emulation of 4 devices
does, into one run dir that global rank 0 alone writes; a node that dies takes the other
down with no process left behind."""

import os
import signal
import subprocess
import time
import uuid

import pytest
from conftest import ROOT, TINY, compose_config
from parallel_helpers import processes_with_env, step_losses

from syncbn_lab.config import PRECISIONS
from syncbn_lab.parallel.gloo_jobs import free_port
from syncbn_lab.train import run

TORCHRUN = ROOT / ".venv" / "bin" / "torchrun"
TRAIN = str(ROOT / "scripts" / "train.py")
STEPS = 4
# float64 where the trainer has it: two ways of summing the same numbers agree to ~1e-15.
# In float32 the 4-rank and emulated sums round differently; 1e-5 relative is the floor the
# emulation proof (test_emulated_matches_ddp.py) measured over 20 steps.
PRECISION, RTOL = ("fp64", 1e-9) if "fp64" in PRECISIONS else ("fp32", 1e-5)
RUN = [*TINY, "bn=sync", f"trainer.precision={PRECISION}", f"trainer.max_steps={STEPS}"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed in .venv"),
]


def start_nodes(tmp_path, overrides, markers):
    """Two torchrun agents, node_rank 0 and 1, two ranks each, one rendezvous on 127.0.0.1
    (on one host both could host its store: node 0 does, as the head node of a cluster);
    each in its own process group, its processes marked by an environment variable."""
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = uuid.uuid4().hex
    nodes = []
    for node_rank, marker in enumerate(markers):
        command = [
            str(TORCHRUN),
            "--nnodes=2",
            "--nproc_per_node=2",
            f"--node_rank={node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}",
            f"--rdzv_id={rdzv_id}",
            f"--rdzv_conf=is_host={int(node_rank == 0)}",  # node 0 hosts the rendezvous store
            "--max_restarts=0",
            TRAIN,
            *overrides,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SYNCBN_LAB_TEST_MARKER": marker}
        log = open(tmp_path / f"node{node_rank}.log", "w")  # noqa: SIM115
        nodes.append(
            subprocess.Popen(
                command,
                cwd=tmp_path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return nodes


def stop(nodes, markers):
    """Kill whatever is left of both nodes (only after a test failed)."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()
    for marker in markers:
        for pid in processes_with_env(marker):
            os.kill(pid, signal.SIGKILL)


def wait_all(nodes, timeout):
    deadline = time.monotonic() + timeout
    for node in nodes:
        node.wait(max(1.0, deadline - time.monotonic()))
    return [node.returncode for node in nodes]


def no_process_left(markers, within=20.0):
    deadline = time.monotonic() + within
    while any(processes_with_env(m) for m in markers):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_two_torchrun_nodes_train_as_four_emulated_devices(tmp_path):
    run_dir = tmp_path / "run"
    markers = [f"node0-{uuid.uuid4().hex}", f"node1-{uuid.uuid4().hex}"]
    nodes = start_nodes(tmp_path, [*RUN, "parallel=ddp", f"hydra.run.dir={run_dir}"], markers)
    try:
        codes = wait_all(nodes, timeout=240)
    finally:
        stop(nodes, markers)
    logs = "".join((tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1))
    assert codes == [0, 0], logs
    # one run dir, written by global rank 0 only: no second Hydra dir, one record per step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node0.log", "node1.log", "run"]
    assert {p.name for p in run_dir.iterdir()} >= {
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "checkpoints",
    }
    ddp = step_losses(run_dir)
    assert len(ddp) == STEPS, ddp

    emulated_dir = tmp_path / "emulated"
    run(compose_config([*RUN, "parallel=emulated", "parallel.devices=4"]), emulated_dir)
    emulated = step_losses(emulated_dir)
    for step, (a, b) in enumerate(zip(ddp, emulated, strict=True), start=1):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: 2 nodes x 2 ranks {a} vs emulated {b}"


def test_a_node_that_dies_takes_the_other_down(tmp_path):
    markers = [f"node0-{uuid.uuid4().hex}", f"node1-{uuid.uuid4().hex}"]
    long_run = [
        *TINY,
        "bn=sync",
        "parallel=ddp",
        "trainer.epochs=1000",
        "trainer.max_steps=100000",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    nodes = start_nodes(tmp_path, long_run, markers)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, "the two nodes never started training"
            assert all(node.poll() is None for node in nodes)
            time.sleep(0.2)
        # node 1's machine goes away: its agent and both of its ranks die at once
        for pid in processes_with_env(markers[1]):
            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        code = nodes[0].wait(timeout=120)
        elapsed = time.monotonic() - started
    finally:
        stop(nodes, markers)
    log = (tmp_path / "node0.log").read_text()
    assert code != 0, log[-3000:]
    assert elapsed < 60, elapsed  # a peer failure, not the 300 s collective timeout
    assert log.count("errors.ChildFailedError") == 1, log[-3000:]  # torchrun's one report
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert errors and all("a collective failed because another rank" in e for e in errors), log
    assert no_process_left(markers), [processes_with_env(m) for m in markers]
