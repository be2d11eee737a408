"""A config whose model, batch or data does not fit: the allocation torch refuses becomes one
line naming the device, the size and the keys to lower (exit status 1), not a traceback; a
sweep's job records it in error.json. The refusals are real (2**47 bytes and more: beyond a
process's address space, refused whatever the machine's memory), except CUDA's, which is
raised as torch raises it."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from conftest import TINY
from helpers import train_cli

from syncbn_lab.errors import OutOfMemory, out_of_memory_is_one_line
from syncbn_lab.multirun import run_job
from syncbn_lab.train import run

# synthetic images of 10**7 x 10**7 pixels: its class prototypes alone are 1.6e15 bytes
TOO_LARGE = ["data.image_size=10000000", "trainer.max_steps=1"]
FIX = "lower model.width, trainer.global_batch_size"


def test_a_run_that_does_not_fit_ends_in_one_line(tmp_path):
    done = train_cli(*TINY, *TOO_LARGE, f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: out of memory: the CPU refused an allocation of "), lines
    assert FIX in lines[0]
    assert not (tmp_path / "summary.json").exists()


def test_a_sweeps_job_that_does_not_fit_records_why(tmp_path, tiny_cfg):
    assert run_job(tiny_cfg(*TOO_LARGE), tmp_path, run) is None
    error = json.loads((tmp_path / "error.json").read_text())
    assert error["reason"] == "out of memory" and FIX in error["error"]


def test_the_cpu_refusal_names_its_size():
    with pytest.raises(OutOfMemory) as info, out_of_memory_is_one_line():
        torch.empty(2**50, dtype=torch.uint8)
    assert f"the CPU refused an allocation of {2**50 / 1e9:,.1f} GB;" in str(info.value)


def test_a_gpu_refusal_names_its_size_and_crosses_processes():
    cuda = torch.OutOfMemoryError(  # as the CUDA caching allocator words it
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 "
        "GiB of which 3.06 GiB is free."
    )
    with pytest.raises(OutOfMemory) as info, out_of_memory_is_one_line():
        raise cuda
    assert "the GPU refused an allocation of 20.00 GiB;" in str(info.value)
    sent = pickle.loads(pickle.dumps(info.value))  # as a DDP rank sends it to its parent
    assert type(sent) is OutOfMemory and str(sent) == str(info.value)


def test_other_runtime_errors_pass_as_they_are():
    other = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x2)")
    with pytest.raises(RuntimeError) as info, out_of_memory_is_one_line():
        raise other
    assert info.value is other
