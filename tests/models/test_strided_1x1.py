"""Strided 1x1 convolutions never reach oneDNN's broken AVX2 kernel (oneDNN issue 6035).

The probe (``strided_1x1_probe.py``) trains a width-4 resnet8 in channels_last and in NCHW
in a subprocess with ``ONEDNN_MAX_CPU_ISA=AVX2``, which makes any x86 CPU with AVX2 take the
AVX2 kernels, so these tests bite on AVX-512 machines too. The canary runs the same probe
with the plain strided convolutions put back: it fails once the installed torch no longer
has the bug, which is when :class:`SubsampledConv1x1` can go.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY
from helpers import AVX2_ENV, TRAIN, needs_avx2, run_avx2
from torch import nn

from syncbn_lab.models.resnet import SubsampledConv1x1, subsample_strided_1x1

PROBE = Path(__file__).with_name("strided_1x1_probe.py")
# channels_last against NCHW after 4 SGD steps: float32 summation order moves parameters by
# ~3e-6 relative; the broken kernel moves them by 1e-2 or more
FLOAT32_ROUNDING = 1e-4
PROBE_SECONDS = 90  # the probe takes 3-4 s on a 2-core CPU
HUNG = -1000  # probe()'s return code for a probe that ran past PROBE_SECONDS


def probe(threads: int, broken: bool = False) -> tuple[int, dict | None, str]:
    args = [str(PROBE), "--threads", str(threads)] + (["--broken"] * broken)
    done = run_avx2(args, PROBE_SECONDS)
    if done is None:
        return HUNG, None, f"no answer after {PROBE_SECONDS} s"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(lines[-1]) if lines else None, done.stderr[-500:]


def test_subsampled_conv_is_the_strided_conv_in_float64():
    torch.manual_seed(0)
    strided = nn.Conv2d(6, 12, 1, stride=2, bias=True).double()
    ours = SubsampledConv1x1(6, 12, stride=2, bias=True).double()
    ours.load_state_dict(strided.state_dict())
    assert list(ours.state_dict()) == list(strided.state_dict())
    for size in (8, 7):  # even and odd: the output has ceil(size / 2) rows either way
        x = torch.randn(3, 6, size, size, dtype=torch.float64, requires_grad=True)
        x_ours = x.detach().clone().requires_grad_()
        out, out_ours = strided(x), ours(x_ours)
        grad = torch.randn_like(out)
        out.backward(grad)
        out_ours.backward(grad)
        torch.testing.assert_close(out_ours, out, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(x_ours.grad, x.grad, rtol=1e-14, atol=1e-14)
        for p, p_ours in zip(strided.parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(p_ours.grad, p.grad, rtol=1e-13, atol=1e-13)
            p.grad = p_ours.grad = None


def test_every_strided_1x1_of_a_model_is_replaced_with_its_parameters():
    model = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2), nn.Conv2d(8, 8, 3, stride=2, padding=1))
    weight = model[0].weight
    subsample_strided_1x1(model)
    assert type(model[0]) is SubsampledConv1x1 and model[0].weight is weight
    assert type(model[1]) is nn.Conv2d  # a 3x3 convolution is left alone


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2])
def test_channels_last_trains_as_nchw_on_avx2(threads):
    returncode, result, stderr = probe(threads)
    assert returncode == 0, f"the probe died ({returncode}): {stderr}"
    assert result["error"] < FLOAT32_ROUNDING, result


@needs_avx2
def test_a_compiled_channels_last_run_survives_on_avx2(tmp_path):
    # Inductor hands a strided view to oneDNN as it is: SubsampledConv1x1 makes it dense
    # (without that, this run crashed 4 times in 4 at one thread)
    compiled = ["trainer.compile=true", "trainer.channels_last=true", "trainer.threads=1"]
    emulated = ["bn=sync", "parallel=emulated", "parallel.devices=4", "trainer.max_steps=2"]
    args = [*TINY, *compiled, *emulated, "trainer.eval_images=32", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(
        [sys.executable, TRAIN, *args], env=AVX2_ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-1500:]
    assert "preflight: gradients match float64" in done.stdout


@needs_avx2
def test_canary_installed_torch_still_has_onednn_6035():
    """Fails when torch no longer has the bug: then remove SubsampledConv1x1.

    The bug shows as parameters that differ, a crash, or a probe that hangs; the first
    thread count that shows it is enough.
    """
    outcomes = []
    for threads in (1, 2):
        outcomes.append(probe(threads, broken=True))
        returncode, result, _ = outcomes[-1]
        if returncode != 0 or result["error"] >= FLOAT32_ROUNDING:
            return
    pytest.fail(
        f"torch {torch.__version__} trains plain strided 1x1 convolutions in channels_last "
        f"as in NCHW under ONEDNN_MAX_CPU_ISA=AVX2 ({[r for _, r, _ in outcomes]}): oneDNN "
        "issue 6035 is fixed here, so SubsampledConv1x1 (models/resnet.py) can go"
    )
