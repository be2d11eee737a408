"""Loads syncbn_lab._C (the compiled fused kernels) once, and says once when it cannot.

The extension is built ahead of time by `pip install --no-build-isolation -e .` (setup.py);
importing it runs its TORCH_LIBRARY blocks, which define the torch.ops.syncbn_lab ops.
`SYNCBN_LAB_EXT=0` in the environment keeps it unloaded (forces the reference path).
"""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path

import torch

from syncbn_lab.errors import warn_one_line

__all__ = ["available", "has_cuda_kernels", "load", "unavailable_reason"]

# Left by setup.py when the build failed (a source checkout installed with -e).
_BUILD_ERROR_FILE = Path(__file__).resolve().parents[3] / "build" / "syncbn_lab_C_build_error.txt"

_lock = threading.Lock()
_loaded: bool | None = None
_reason: str | None = None
_warned = False


def load() -> bool:
    """Imports syncbn_lab._C once; True when its ops are registered. Never raises, never warns."""
    global _loaded, _reason
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if os.environ.get("SYNCBN_LAB_EXT", "1").strip() == "0":
            _loaded, _reason = False, "disabled by SYNCBN_LAB_EXT=0"
            return False
        try:
            importlib.import_module("syncbn_lab._C")
            torch.ops.syncbn_lab.local_stats.default  # noqa: B018 - raises if the ops are missing
        except Exception as error:  # ImportError, OSError (ABI), AttributeError (no ops)
            _loaded, _reason = False, f"{type(error).__name__}: {error}".splitlines()[0]
            if isinstance(error, ModuleNotFoundError) and _BUILD_ERROR_FILE.is_file():
                _reason = _BUILD_ERROR_FILE.read_text().strip().splitlines()[0]
        else:
            _loaded = True
        return _loaded


def unavailable_reason() -> str | None:
    """Why the extension is not loaded (None when it is)."""
    load()
    return _reason


def available(warn: bool = True) -> bool:
    """True when the fused kernels can be used; else warns once (if `warn`) and returns False."""
    global _warned
    if load():
        return True
    if warn and not _warned:
        _warned = True
        warn_one_line(
            f"syncbn_lab._C is not built ({_reason}); using the reference implementation. "
            "Build it with `make build-ext`.",
            RuntimeWarning,
        )
    return False


def has_cuda_kernels() -> bool:
    """True when the loaded extension was built with its CUDA kernels."""
    return load() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "syncbn_lab::local_stats", "CUDA"
    )
