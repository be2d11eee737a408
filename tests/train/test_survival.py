"""What survives what: divergence stops every rank at one step, a stop signal leaves a
checkpoint from which the run continues bitwise (fp32, one thread), and a bad checkpoint is
one line before anything is written. The reference is always the same run uninterrupted."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY
from helpers import TRAIN, as_in_a_terminal, assert_one_line_error, live_members, train_cli

from syncbn_lab.engine import checkpoint, preemption
from syncbn_lab.errors import Diverged, Preempted
from syncbn_lab.faults import fault_override
from syncbn_lab.multirun import ERROR_FILE, run_job
from syncbn_lab.train import run

# 256 images, 32 a step: 8 steps an epoch, 10 epochs = 80 steps; step 31 is mid-epoch.
LONG = [*TINY, "trainer.epochs=10", "trainer.threads=1", "parallel=emulated", "parallel.devices=4"]


def final_params(run_dir):
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def training_records(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "images_per_s"} for r in records]


def test_sigterm_at_step_31_of_80_then_resume_is_bitwise_the_uninterrupted_run(tmp_path, tiny_cfg):
    whole = run(tiny_cfg(*LONG[len(TINY) :]), tmp_path / "whole")
    stopped = train_cli(*LONG, fault_override("term", 0, 31), f"hydra.run.dir={tmp_path / 'a'}")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    lines = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: stopped by SIGTERM at step 31; checkpoint {tmp_path / 'a'}/checkpoints/last.pt;"
        f" continue with trainer.resume={tmp_path / 'a'}"
    ]
    saved = checkpoint.load(tmp_path / "a" / "checkpoints" / "last.pt")
    assert (saved["step"], saved["epoch"], saved["step_in_epoch"]) == (31, 3, 7)

    resumed = run(tiny_cfg(*LONG[len(TINY) :], f"trainer.resume={tmp_path / 'a'}"), tmp_path / "b")
    assert resumed["steps"] == whole["steps"] == 80
    assert_bitwise_equal(final_params(tmp_path / "whole"), final_params(tmp_path / "b"))
    for key in ("test_loss", "train_loss", "best_val_acc"):
        assert resumed[key] == whole[key], key
    after = [r for r in training_records(tmp_path / "whole") if r["step"] > 31]
    assert training_records(tmp_path / "b") == after  # the same log from step 32 on


def test_a_preempted_multirun_job_continues_in_its_own_run_dir(tmp_path, tiny_cfg):
    """What a requeued SLURM job or `sweep --resume` does: the job finds its unfinished run
    and its checkpoint, and continues it there."""
    settings = ("trainer.max_steps=12", "trainer.threads=1", "trainer.checkpoint_every=4")
    run(tiny_cfg(*settings), tmp_path / "whole")
    job = tmp_path / "job"
    stopped_at_6 = (*settings, fault_override("term", 0, 6))  # the job's config, both times
    with pytest.raises(SystemExit) as stopped:  # the job stops, and leaves no result
        run_job(tiny_cfg(*stopped_at_6), job, run)
    assert stopped.value.code == 128 + signal.SIGTERM
    record = json.loads((job / ERROR_FILE).read_text())
    assert record["reason"] == "preempted" and "step 6" in record["error"]
    assert checkpoint.load(job / "checkpoints" / "last.pt")["step"] == 6

    again = run_job(tiny_cfg(*stopped_at_6), job, run)
    assert again is not None and again["steps"] == 12 and not (job / ERROR_FILE).exists()
    assert_bitwise_equal(final_params(tmp_path / "whole"), final_params(job))
    assert training_records(job) == training_records(tmp_path / "whole")  # no record twice


def test_checkpoint_every_writes_within_the_epoch(tmp_path, tiny_cfg):
    cfg = tiny_cfg(
        "trainer.max_steps=5", "trainer.checkpoint_every=2", fault_override("raise", 0, 5)
    )
    with pytest.raises(RuntimeError, match="injected fault"):
        run(cfg, tmp_path)
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")
    assert (saved["step"], saved["epoch"], saved["step_in_epoch"]) == (4, 0, 4)


def test_divergence_stops_the_run_at_that_step(tmp_path, tiny_cfg):
    cfg = tiny_cfg(
        "parallel=emulated", "parallel.devices=2", "optim.lr=1e6", "trainer.max_steps=30"
    )
    with pytest.raises(Diverged, match=r"^diverged at step \d+: the training loss is nan") as info:
        run(cfg, tmp_path / "emulated")
    last = training_records(tmp_path / "emulated")[-1]
    assert last["step"] == info.value.step < 30 and last["train/loss"] is None
    assert not (tmp_path / "emulated" / "summary.json").exists()

    job = tmp_path / "job"
    assert run_job(cfg, job, run) is None
    assert json.loads((job / ERROR_FILE).read_text())["reason"] == "diverged"


@pytest.mark.slow
def test_divergence_on_one_ddp_rank_stops_every_rank_at_the_same_step(tmp_path, tiny_cfg):
    fault = fault_override("diverge", 1, 3)
    cfg = tiny_cfg("parallel=ddp", "parallel.devices=2", "trainer.max_steps=30", fault)
    started = time.monotonic()
    with pytest.raises(Diverged, match=r"^diverged at step 4: "):
        run(cfg, tmp_path)  # rank 1's loss is nan at step 4; rank 0's is not
    assert time.monotonic() - started < 60  # no collective waited for its timeout
    # rank 0 (which logs) stopped at step 4 too, on the reduced loss, not its own finite one
    last = training_records(tmp_path)[-1]
    assert (last["step"], last["train/loss"]) == (4, None)


@pytest.mark.slow
def test_sigterm_on_one_ddp_rank_stops_both_and_the_resume_is_bitwise(tmp_path, tiny_cfg):
    settings = ("parallel=ddp", "parallel.devices=2", "trainer.max_steps=12", "trainer.threads=1")
    whole = run(tiny_cfg(*settings), tmp_path / "whole")
    with pytest.raises(Preempted, match="stopped by SIGTERM at step 5;"):
        run(tiny_cfg(*settings, fault_override("term", 1, 5)), tmp_path / "a")
    saved = checkpoint.load(tmp_path / "a" / "checkpoints" / "last.pt")
    assert saved["step"] == 5 and len(saved["ranks"]) == 2
    resumed = run(tiny_cfg(*settings, f"trainer.resume={tmp_path / 'a'}"), tmp_path / "b")
    assert resumed["steps"] == whole["steps"] == 12
    assert_bitwise_equal(final_params(tmp_path / "whole"), final_params(tmp_path / "b"))
    assert resumed["train_loss"] == whole["train_loss"]


def test_a_stop_signal_is_forwarded_to_the_supervised_ranks():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    before = signal.getsignal(signal.SIGTERM)
    try:
        with preemption.stop_signals(), preemption.forward_to([child.pid]):
            os.kill(os.getpid(), signal.SIGTERM)
            assert preemption.requested() == signal.SIGTERM  # this process: only a request
            assert child.wait(timeout=10) == -signal.SIGTERM  # the rank got it too
    finally:
        child.kill()
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
    assert preemption.requested() is None


def test_slurms_warning_signal_is_handed_to_the_handler_before_after_the_checkpoint():
    """SIGUSR2 (submitit's time-limit warning) only sets the request while the run trains;
    ``chain`` then runs the handler that was there before (submitit's: requeue the job)."""
    calls = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        with preemption.stop_signals():
            os.kill(os.getpid(), signal.SIGUSR2)
            assert preemption.requested() == signal.SIGUSR2 and calls == []
        preemption.chain(signal.SIGUSR2)
        assert calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, before)


@pytest.mark.slow
def test_ctrl_c_of_a_ddp_run_stops_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "parallel=ddp", "parallel.devices=2", "trainer.epochs=1000"]
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *args, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=as_in_a_terminal,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # training, past the first records
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        assert proc.wait(timeout=60) != 0
        # The forkserver leaves when the launcher has gone, after its interpreter's teardown
        # (about 0.7 s with torch imported on an idle 2-core machine, longer under load).
        deadline = time.monotonic() + 30
        while (left := live_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("case", ["truncated", "another model"])  # the rest: test_checkpoint
def test_a_bad_checkpoint_is_one_line_and_no_run_dir(tmp_path, tiny_cfg, case):
    source = tmp_path / "source"
    run(tiny_cfg("trainer.max_steps=2"), source)
    last = source / "checkpoints" / "last.pt"
    overrides = []
    if case == "truncated":
        last.write_bytes(last.read_bytes()[:1000])
    else:
        overrides = ["model.width=8"]
    target = tmp_path / "target"
    result = train_cli(*TINY, *overrides, f"trainer.resume={source}", f"hydra.run.dir={target}")
    assert_one_line_error(result)
    assert result.stderr.strip().startswith(f"error: trainer.resume: {last}")
    assert "weights_only" not in result.stderr  # torch's advice to load unsafely
    assert not target.exists()


def test_the_survival_table_in_docs_names_tests_that_exist():
    import re

    table = (ROOT / "docs" / "parallel.md").read_text().split("### What survives what")[1]
    table = table.split("\n### ")[0]
    cited = 0
    for row in (line for line in table.splitlines() if line.startswith("| ")):
        current = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", row):
            current = path or current
            if not current:
                continue
            source = (ROOT / current).read_text()
            assert name == "" or f"def {name}(" in source, (current, name)
            cited += 1
    assert cited >= 10
