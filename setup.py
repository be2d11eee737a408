"""Build hook for the optional C++/CUDA extension syncbn_lab._C; metadata lives in pyproject.toml.

`pip install --no-build-isolation -e .` compiles csrc/ ahead of time:

- a CppExtension (csrc/*.cpp) by default;
- a CUDAExtension (plus csrc/cuda/*.cu) when SYNCBN_LAB_CUDA=1, or when it is unset and a GPU
  is visible, provided torch is a CUDA build and a CUDA toolkit is found. The toolkit is the
  folder whose bin/nvcc and lib64/libcudart.so both exist: $CUDA_HOME, the target of an
  `nvcc` wrapper script on PATH, or /usr/local/cuda*. TORCH_CUDA_ARCH_LIST defaults to
  "8.0;9.0+PTX";
- nothing when SYNCBN_LAB_EXT=0.

SYNCBN_LAB_CUDA=0 forces the CPU-only build. A failed build never fails the install: it
prints one line and the package runs on its reference implementation
(syncbn_lab.nn._ext says so once at run time). `make build-ext` rebuilds.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
PY_LIMITED_API = "0x030A0000"  # CPython 3.10: the module defines no Python API of its own
# Where a failed build leaves its reason; syncbn_lab.nn._ext quotes it in its warning.
BUILD_ERROR_FILE = ROOT / "build" / "syncbn_lab_C_build_error.txt"


def _say(message: str) -> None:
    print(f"syncbn-lab setup: {message}", file=sys.stderr, flush=True)


def _is_toolkit(home: Path) -> bool:
    libs = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")
    return (home / "bin" / "nvcc").is_file() and any(
        (home / lib / "libcudart.so").exists() for lib in libs
    )


def _homes_named_by_wrapper(nvcc: Path) -> list[Path]:
    """Toolkit folders named inside an `nvcc` that is a small wrapper script, not the compiler."""
    try:
        if nvcc.stat().st_size > 64 * 1024:
            return []
        text = nvcc.read_text(errors="ignore")
    except OSError:
        return []
    if not text.startswith("#!"):
        return []
    return [Path(m) for m in re.findall(r"(/[^\s'\"$;]+)/bin/nvcc\b", text)]


def find_cuda_toolkit() -> Path | None:
    """The CUDA toolkit's own folder, or None."""
    candidates: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(real.parent.parent)
        candidates.extend(_homes_named_by_wrapper(real))
    candidates.append(Path("/usr/local/cuda"))
    candidates.extend(sorted(Path("/usr/local").glob("cuda-*"), reverse=True))
    for home in candidates:
        if _is_toolkit(home):
            return home.resolve()
    return None


def _loaded_libstdcxx() -> str | None:
    """The file of the libstdc++ this process has loaded (torch's), on Linux; else None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1]
        if "/libstdc++.so" in path and Path(path).is_file():
            return path
    return None


def _want_cuda(torch) -> tuple[bool, str]:
    choice = os.environ.get("SYNCBN_LAB_CUDA", "").strip().lower()
    if choice in ("0", "false", "no", "off"):
        return False, "SYNCBN_LAB_CUDA=0"
    if torch.version.cuda is None:
        return False, "torch is not a CUDA build"
    if choice not in ("1", "true", "yes", "on") and not torch.cuda.is_available():
        return False, "no GPU visible (SYNCBN_LAB_CUDA=1 builds the CUDA kernels anyway)"
    home = find_cuda_toolkit()
    if home is None:
        return False, "no CUDA toolkit found (set CUDA_HOME to the folder holding bin/nvcc)"
    os.environ["CUDA_HOME"] = str(home)
    return True, f"CUDA toolkit {home}"


def extension_setup() -> dict:
    """ext_modules and cmdclass for setup(), or {} when the extension is not to be built."""
    if os.environ.get("SYNCBN_LAB_EXT", "1").strip() == "0":
        _say("SYNCBN_LAB_EXT=0: not building syncbn_lab._C")
        return {}
    try:
        import torch
    except ImportError as error:
        _say(f"torch is not importable ({error}); not building syncbn_lab._C")
        return {}
    with_cuda, why = _want_cuda(torch)
    # CUDA_HOME must be final before torch.utils.cpp_extension is imported: it reads it then.
    from torch.utils import cpp_extension

    # -g0: no debug info (Python's own flags add -g), a faster build and a 10x smaller .so.
    cxx_flags = ["-O3", "-g0", "-ffp-contract=off", f"-DPy_LIMITED_API={PY_LIMITED_API}"]
    link_flags = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is serial unless the extension itself is compiled with OpenMP;
        # libgomp.so.1 then resolves to the copy torch has already loaded.
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
        # The libstdc++ torch runs with, shared: one CUDA image's g++ wrapper finds only a
        # static libstdc++.a, and a module with its own copy crashed the process on every C++
        # exception (each TORCH_CHECK) instead of raising RuntimeError.
        libstdcxx = _loaded_libstdcxx()
        if libstdcxx:
            link_flags.append(libstdcxx)
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        sources += sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cuda").glob("*.cu"))
        extension = cpp_extension.CUDAExtension(
            "syncbn_lab._C",
            sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=link_flags,
            py_limited_api=True,
        )
        archs = os.environ["TORCH_CUDA_ARCH_LIST"]
        _say(f"building syncbn_lab._C with CUDA ({why}, archs {archs})")
    else:
        extension = cpp_extension.CppExtension(
            "syncbn_lab._C",
            sources,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
            py_limited_api=True,
        )
        _say(f"building syncbn_lab._C for CPU only ({why})")

    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """Builds the extension, or says in one line why not and lets the install go on."""

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as error:  # noqa: BLE001 - any failure leaves the reference path
                reason = (str(error).strip().splitlines() or [type(error).__name__])[-1]
                _say(
                    f"building {ext.name} FAILED ({reason}); the package will use its "
                    "reference implementation. Fix the error and run `make build-ext` "
                    "(pip -v shows the compiler's output)."
                )
                BUILD_ERROR_FILE.parent.mkdir(parents=True, exist_ok=True)
                BUILD_ERROR_FILE.write_text(f"its build failed: {reason}\n")
            else:
                BUILD_ERROR_FILE.unlink(missing_ok=True)

    extension.optional = True  # setuptools then skips copying a .so that failed to build
    return {
        "ext_modules": [extension],
        "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)},
    }


if __name__ == "__main__":  # also under pip: setuptools runs this file as __main__
    setup(**extension_setup())
