"""A torchrun rank ends through syncbn_lab.parallel.ddp.run_torchrun_rank: as Python's own
exit does (the exit code of main's SystemExit, the atexit functions, the flushed streams) but
without the interpreter's teardown, during which gloo's worker threads abort the process. Each
case runs in a fresh interpreter beside a control that exits the usual way. Ranks the lab
starts with spawn end through exit_rank too (forkserver's children never reach a teardown:
their server ends them with os._exit)."""

import atexit
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from syncbn_lab.parallel.ddp import launch_ddp
from syncbn_lab.shape import RunShape

SCRIPT = """
import atexit, sys
from pathlib import Path

out = Path(sys.argv[1])

class TornDown:
    def __del__(self):  # runs only in the interpreter's teardown
        (out / "teardown").write_text("x")

kept = TornDown()

def main():
    atexit.register(lambda: (out / "atexit").write_text("x"))
    print("no newline", end="")  # still in the buffer at the end
    print("to stderr", end="", file=sys.stderr)
    raise SystemExit({code!r})

if sys.argv[2] == "rank":
    from syncbn_lab.parallel.ddp import run_torchrun_rank
    run_torchrun_rank(main)
else:
    main()
"""


def leave(tmp_path, how, code):
    out = tmp_path / how
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(code=code), str(out), how],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize("code", [0, 3, None, "error: a message"])
def test_a_rank_exits_as_python_does_less_the_teardown(tmp_path, code):
    control, control_files = leave(tmp_path, "control", code)
    rank, rank_files = leave(tmp_path, "rank", code)
    assert control_files == ["atexit", "teardown"]  # the teardown the rank must skip
    assert rank_files == ["atexit"]
    assert rank.returncode == control.returncode == {0: 0, 3: 3, None: 0}.get(code, 1)
    assert rank.stdout == control.stdout == "no newline"
    assert rank.stderr == control.stderr
    assert rank.stderr.startswith("to stderr")
    if isinstance(code, str):
        assert rank.stderr == "to stderr" + code + "\n"


class TornDown:
    def __init__(self, path: Path):
        self.path = path

    def __del__(self):  # runs only in the interpreter's teardown
        self.path.write_text("x")


def summed_ranks(rt, cfg, shape, run_dir):
    atexit.register((run_dir / f"atexit{rt.rank}").write_text, "x")
    sys.modules["__main__"].kept = TornDown(run_dir / f"teardown{rt.rank}")  # torn down first
    value = torch.tensor([float(rt.rank + 1)])
    dist.all_reduce(value)
    return {"sum": value.item()}


def test_ranks_started_by_spawn_report_and_exit_without_the_teardown(tmp_path):
    cfg = OmegaConf.create(
        {"parallel": {"devices": 2, "start_method": "spawn", "timeout_s": 60},
         "trainer": {"threads": 1}}
    )  # fmt: skip
    shape = RunShape(
        variant="bn", mode="ddp", devices=2, per_device_batch_size=1, slices_per_process=1,
        device_slices=1, normalization_batch_size=1, device="cpu", backend="gloo",
    )  # fmt: skip
    assert launch_ddp(cfg, shape, summed_ranks, tmp_path) == {"sum": 3.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit0", "atexit1"]
