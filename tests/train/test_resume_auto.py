"""trainer.resume=auto: a supervisor reruns one command and the run continues from its run
dir's own last checkpoint (bitwise the uninterrupted run), starts afresh where there is none,
and leaves a finished run alone. The reference is the same run uninterrupted."""

import json
import signal

import torch
from conftest import TINY
from helpers import train_cli

from syncbn_lab.engine import checkpoint
from syncbn_lab.faults import fault_override
from syncbn_lab.run_dir import decide
from syncbn_lab.train import run

SETTINGS = ("trainer.max_steps=12", "trainer.threads=1", "trainer.checkpoint_every=4")


def records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "images_per_s"} for r in rows]


def params(run_dir):
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]


def test_one_command_rerun_by_a_supervisor_continues_bitwise_and_then_stays_finished(
    tmp_path, tiny_cfg
):
    whole = run(tiny_cfg(*SETTINGS), tmp_path / "whole")
    job = tmp_path / "job"
    command = [*TINY, *SETTINGS, "trainer.resume=auto", f"hydra.run.dir={job}"]
    stopped = train_cli(*command, fault_override("term", 0, 6))  # preempted at step 6
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert checkpoint.load(job / "checkpoints" / "last.pt")["step"] == 6
    assert max(r["step"] for r in records(job)) >= 6

    again = train_cli(*command)  # the same command, as a restarting supervisor runs it
    assert again.returncode == 0, again.stderr
    assert f"resuming: {job} from its last checkpoint" in again.stderr
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["test_loss"], summary["steps"]) == (whole["test_loss"], whole["steps"])
    assert records(job) == records(tmp_path / "whole")  # no record twice, none missing
    for key, value in params(tmp_path / "whole").items():
        assert torch.equal(value, params(job)[key]), key

    before = (job / "metrics.jsonl").read_text(), (job / "summary.json").read_text()
    done = train_cli(*command)  # a finished run: nothing to do, nothing changed
    assert done.returncode == 0, done.stderr
    assert f"{job} holds a finished run; nothing to do" in done.stderr
    assert ((job / "metrics.jsonl").read_text(), (job / "summary.json").read_text()) == before


def test_auto_without_a_checkpoint_starts_afresh_and_drops_what_the_dead_run_logged(
    tmp_path, tiny_cfg
):
    job = tmp_path / "job"
    chosen = decide(tiny_cfg("trainer.resume=auto"), job)  # a new run dir: a fresh start
    assert (chosen.resume, chosen.note, chosen.clear) == (None, None, False)
    job.mkdir()
    (job / "metrics.jsonl").write_text('{"step": 1, "train/loss": 9.0}\n')  # died before a save
    cfg = tiny_cfg(*SETTINGS, "trainer.resume=auto")
    chosen = decide(cfg, job)
    assert chosen.clear and chosen.resume is None and "holds no checkpoint yet" in chosen.note
    assert cfg.trainer.resume is None  # the worker sees no "auto"
    summary = run(tiny_cfg(*SETTINGS, "trainer.resume=auto"), job)
    whole = run(tiny_cfg(*SETTINGS), tmp_path / "whole")
    assert summary["test_loss"] == whole["test_loss"]
    assert records(job) == records(tmp_path / "whole")


def test_auto_refuses_a_checkpoint_of_other_settings_in_one_line(tmp_path, tiny_cfg):
    job = tmp_path / "job"
    stopped = train_cli(*TINY, *SETTINGS, f"hydra.run.dir={job}", fault_override("term", 0, 5))
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    other = train_cli(
        *TINY, *SETTINGS, "trainer.seed=7", "trainer.resume=auto", f"hydra.run.dir={job}"
    )
    assert other.returncode == 2, other.stderr
    lines = [line for line in other.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "trainer.seed=0, this run has trainer.seed=7" in lines[0], lines


def test_a_sweep_job_with_auto_continues_its_checkpoint_instead_of_clearing_it(tmp_path, tiny_cfg):
    """A multirun job (skip_finished, as sweep.py runs them) given trainer.resume=auto: its
    unfinished run continues from its checkpoint, it is not cleared and retrained."""
    from syncbn_lab.multirun import run_job

    whole = run(tiny_cfg(*SETTINGS), tmp_path / "whole")
    job = tmp_path / "job"
    fault = fault_override("term", 0, 6)  # the job's config, both times (a sweep checks it)
    settings = (*SETTINGS, "trainer.resume=auto", fault)
    stopped = train_cli(*TINY, *settings, f"hydra.run.dir={job}")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    summary = run_job(tiny_cfg(*settings, "skip_finished=true"), job, run)
    assert summary is not None and summary["test_loss"] == whole["test_loss"]
    assert summary["resumed_from"] == str(job)  # continued, not retrained from step 0
    assert records(job) == records(tmp_path / "whole")
