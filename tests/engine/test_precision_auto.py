"""trainer.precision=auto: bf16 autocast where the CPU (or GPU) computes bf16 natively,
fp32 elsewhere, resolved once before a run (or a sweep) starts and recorded where the run's
outputs say what it did. An AVX2 CPU without bf16 instructions is emulated on this machine
by ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN then reports no bf16 support) in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import TINY
from helpers import AVX2_ENV, TRAIN, needs_avx2
from omegaconf import OmegaConf

from syncbn_lab.engine.precision import native_bf16, resolve
from syncbn_lab.sweep import pin_precision, plan

AVX2 = AVX2_ENV
CPU = torch.device("cpu")


def python(code: str, env: dict) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def train(tmp_path, env, *overrides):
    args = [*TINY, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}", *overrides]
    return subprocess.run(
        [sys.executable, TRAIN, *args], env=env, capture_output=True, text=True, timeout=180
    )


def test_auto_follows_the_cpus_bf16_support_and_explicit_choices_stay():
    assert resolve("auto", CPU) == ("bf16" if native_bf16(CPU) else "fp32")
    assert all(resolve(p, CPU) == p for p in ("fp32", "fp64", "bf16", "fp16"))


@needs_avx2
def test_auto_is_fp32_without_bf16_instructions():
    code = (
        "import torch; from syncbn_lab.engine.precision import resolve, native_bf16; "
        "print(resolve('auto', torch.device('cpu')), native_bf16(torch.device('cpu')), "
        "torch.backends.cpu.get_cpu_capability())"
    )
    assert python(code, AVX2).split() == ["fp32", "False", "AVX2"]


@needs_avx2
def test_an_auto_run_records_its_choice_and_explicit_bf16_warns_once(tmp_path):
    done = train(tmp_path / "auto", AVX2, "trainer.precision=auto")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "precision: fp32 (CPU AVX2, bf16 instructions no)" in done.stdout
    assert "bf16" not in done.stderr
    assert OmegaConf.load(tmp_path / "auto" / "config.yaml").trainer.precision == "fp32"
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert (summary["precision"], summary["cpu_isa"], summary["cpu_bf16"]) == (
        "fp32",
        "AVX2",
        False,
    )
    assert "\nprecision      fp32\n" in done.stdout  # the end-of-run block

    done = train(tmp_path / "bf16", AVX2, "trainer.precision=bf16")
    assert done.returncode == 0, done.stderr[-2000:]
    warned = [line for line in done.stderr.splitlines() if "trainer.precision=bf16" in line]
    assert len(warned) == 1, done.stderr
    assert "slower than in float32; use trainer.precision=auto" in warned[0]
    assert json.loads((tmp_path / "bf16" / "summary.json").read_text())["precision"] == "bf16"


def precisions(parts: list[dict]) -> set[str]:
    return {o for part in parts for o in part["overrides"] if o.startswith("trainer.precision=")}


def test_a_sweep_pins_one_precision_in_every_run():
    parts = pin_precision("bn_vs_syncbn", plan("bn_vs_syncbn", False, "emulated", "joblib", []))
    assert precisions(parts) == {f"trainer.precision={resolve('auto', CPU)}"}
    explicit = plan("bn_vs_syncbn", False, "emulated", "joblib", ["trainer.precision=fp64"])
    assert precisions(pin_precision("bn_vs_syncbn", explicit)) == {"trainer.precision=fp64"}


@needs_avx2
def test_a_sweep_started_without_bf16_instructions_pins_fp32():
    code = (
        "from syncbn_lab.sweep import pin_precision, plan; "
        "parts = pin_precision('bn_vs_syncbn', plan('bn_vs_syncbn', False, 'emulated', "
        "'joblib', [])); "
        "print(sorted({o for p in parts for o in p['overrides'] if 'precision' in o}))"
    )
    assert python(code, AVX2) == "['trainer.precision=fp32']"
