"""The CUDA sources compile (nvcc exists on machines without a GPU), and setup.py finds the
CUDA toolkit's own folder behind an `nvcc` wrapper script."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[2]
CUDA_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))


def load_setup_module():
    spec = importlib.util.spec_from_file_location("syncbn_lab_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() runs only as __main__
    return module


def test_toolkit_is_found_behind_a_wrapper_script(tmp_path, monkeypatch):
    setup_module = load_setup_module()
    home = tmp_path / "cuda-99.9"
    (home / "bin").mkdir(parents=True)
    (home / "lib64").mkdir()
    (home / "bin" / "nvcc").write_text("")
    (home / "lib64" / "libcudart.so").write_text("")
    wrapper_dir = tmp_path / "wrapper"
    wrapper_dir.mkdir()
    wrapper = wrapper_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {home}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrapper_dir))
    assert setup_module.find_cuda_toolkit() == home.resolve()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))  # not a toolkit: skipped
    assert setup_module.find_cuda_toolkit() == home.resolve()


def find_nvcc() -> str | None:
    home = load_setup_module().find_cuda_toolkit()
    if home is not None:
        return str(home / "bin" / "nvcc")
    return shutil.which("nvcc")


@pytest.mark.nvcc
@pytest.mark.slow
def test_cuda_sources_compile(tmp_path):
    """nvcc on every .cu with torch's headers and flags, down to PTX for one architecture
    (sm_90): nvcc's C++ front end reads the whole file, host and device code, and the device
    code is compiled. It skips the host compiler and ptxas, three quarters of a full ``-c``
    (17 s against 60 s here); the host side is compiled by g++ in test_cuda_emulated.py, and
    the full build is `make build-ext` on a machine with CUDA (scripts/gpu_check.sh)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    assert CUDA_SOURCES, "no CUDA sources under csrc/cuda"
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    for source in CUDA_SOURCES:
        obj = tmp_path / (source.stem + ".ptx")
        cmd = [
            nvcc,
            "--ptx",
            str(source),
            "-o",
            str(obj),
            *includes,
            *cpp_extension.COMMON_NVCC_FLAGS,
            "-std=c++20",
            "--compiler-options=-fPIC",
            "-gencode=arch=compute_90,code=sm_90",
            "-O3",
        ]
        start = time.monotonic()
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stderr[-4000:]}"
        assert obj.stat().st_size > 0
        assert "warning" not in result.stderr.lower(), result.stderr[-4000:]
        print(f"{source.name}: compiled in {time.monotonic() - start:.0f} s")
