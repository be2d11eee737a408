"""`pip install syncbn-lab` with torch alone: the wheel is built from this checkout (once with
the C++ kernels, once without), each is installed into a new virtual environment that holds
torch and the packages torch requires and nothing else, and there two gloo ranks run a
SyncBatchNorm step that must equal BatchNorm2d on the whole batch in float64.

The new environments see this environment's torch instead of a copy of it (5.6 GB for a CUDA
build): every file of torch and of its requirements, as their RECORDs list them, with their
.dist-info folders, is linked into one folder that a .pth file puts on the new environment's
path, so pip sees those distributions as installed. pip then installs the wheel from the wheel
file alone (no index, no find-links): a requirement outside torch's fails the install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from torch_alone import LAB_MODULES, link_distributions, requirement_closure

ROOT = Path(__file__).resolve().parents[2]
STEP_SCRIPT = Path(__file__).with_name("wheel_gloo_step.py")
TOLERANCE = 1e-12  # float64: the layer's global statistics and torch's full-batch ones

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment less pip's settings (its config files, find-links, indexes) and
    Python's path settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def run(args: list, timeout: float, cwd: Path, **extra_env: str) -> subprocess.CompletedProcess:
    """Runs ``args`` in ``cwd`` with :func:`clean_env`; fails the test unless it succeeds."""
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**extra_env),
        cwd=cwd,
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


def build_wheel(source: Path, out: Path, **env: str) -> Path:
    """``pip wheel`` of ``source`` as a user's pip builds it here (setup.py with this torch)."""
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "--no-index", "--quiet", "-w", out, source],
        timeout=800,
        cwd=out.parent,
        **env,
    )  # fmt: skip
    (wheel,) = out.glob("syncbn_lab-*.whl")
    return wheel


@pytest.fixture(scope="module")
def torch_alone(tmp_path_factory) -> Path:
    """A folder holding torch and its requirements (links), for a .pth file to point at."""
    folder = tmp_path_factory.mktemp("torch_alone")
    link_distributions(requirement_closure("torch"), folder)
    return folder


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """This checkout's wheel with the CPU kernels, and without them (SYNCBN_LAB_EXT=0)."""
    source = tmp_path_factory.mktemp("source")
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for name in ("src", "csrc"):
        shutil.copytree(ROOT / name, source / name, ignore=skip)
    out = tmp_path_factory.mktemp("wheels")
    return {
        "kernels": build_wheel(source, out / "kernels", SYNCBN_LAB_CUDA="0"),
        "reference": build_wheel(source, out / "reference", SYNCBN_LAB_EXT="0"),
    }


def new_environment(folder: Path, torch_alone: Path, wheel: Path) -> Path:
    """A new virtual environment with torch alone (linked), and ``wheel`` installed by pip
    from the file alone; returns its python."""
    run([sys.executable, "-m", "venv", "--without-pip", folder], timeout=120, cwd=folder.parent)
    python = folder / "bin" / "python"
    (site,) = folder.glob("lib/python*/site-packages")
    (site / "torch_alone.pth").write_text(f"{torch_alone}\n")
    pip = [sys.executable, "-m", "pip", "--python", python]
    run([*pip, "install", "--no-index", "--quiet", wheel], timeout=300, cwd=folder)
    run([*pip, "check"], timeout=120, cwd=folder)  # every distribution's requirements are there
    return python


def wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def unconditional_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = archive.read(name).decode().splitlines()
    return [
        line.split(":", 1)[1].strip()
        for line in lines
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]


@pytest.mark.parametrize("build", ["kernels", "reference"])
def test_wheel_runs_syncbn_with_torch_alone(build, wheels, torch_alone, tmp_path):
    wheel = wheels[build]
    assert unconditional_requirements(wheel) == ["torch>=2.5"]
    kernels_in_wheel = [n for n in wheel_files(wheel) if re.match(r"syncbn_lab/_C\..*so$", n)]
    assert bool(kernels_in_wheel) == (build == "kernels"), kernels_in_wheel

    python = new_environment(tmp_path / "venv", torch_alone, wheel)
    importable = run(
        [python, "-I", "-c",
         "import importlib.util as u, json, sys;"
         "print(json.dumps([m for m in sys.argv[1:] if u.find_spec(m)]))", *LAB_MODULES],
        timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    assert json.loads(importable.stdout) == [], "the new environment is not torch alone"

    results = tmp_path / "results"
    results.mkdir()
    run(
        [python, "-I", "-B", STEP_SCRIPT, results],
        timeout=300,
        cwd=tmp_path,
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    for rank in range(2):
        found = json.loads((results / f"rank{rank}.json").read_text())
        assert Path(found["package"]).is_relative_to(tmp_path / "venv"), found["package"]
        assert found["kernels"] == (build == "kernels")
        impls = ["auto", "fused"] if build == "kernels" else ["auto"]
        assert sorted(k for k in found if k in ("auto", "fused")) == impls
        for impl in impls:
            bad = {k: e for k, e in found[impl].items() if not e < TOLERANCE}
            assert not bad, f"rank {rank}, impl={impl}: differences from BatchNorm2d {bad}"
        if build == "kernels":
            assert found["warnings"] == []
        else:
            assert found["warnings"] == [
                "UserWarning: bn impl auto -> reference (extension not built: "
                "ModuleNotFoundError: No module named 'syncbn_lab._C')"
            ]
