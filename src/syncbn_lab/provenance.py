"""Where a figure comes from: the commit, the machine and the software it was measured with.

Every benchmark's JSON output carries ``provenance()`` as its ``meta``, so a committed figure
names what produced it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

_SOURCE = Path(__file__).resolve().parent

TRAINING_PATH = ("src/syncbn_lab", "csrc", "configs", "scripts/train.py")
"""What decides how a run trains, relative to the checkout: :func:`training_code` hashes it."""
NOT_TRAINING = (
    "src/syncbn_lab/report",
    "src/syncbn_lab/sweep.py",
    "src/syncbn_lab/archive.py",
    "src/syncbn_lab/bench.py",
)
"""Inside TRAINING_PATH but only read after (the report), around (the sweep) or beside (the
benchmarks' harness) the runs."""
TRAINED_SUFFIXES = (".py", ".yaml", ".cpp", ".cu", ".h", ".cuh")


def git_commit() -> str | None:
    """The commit of this source tree, or None outside a git checkout."""
    return _git("rev-parse", "HEAD")


def git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (None outside a git checkout)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=_SOURCE, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def training_code(root: Path | None = None) -> str:
    """A hash of the source that decides how a run trains (TRAINING_PATH less NOT_TRAINING,
    as the working tree has it, uncommitted edits included): runs with the same hash trained
    with the same code, whichever commit they name; a commit that changes only the report
    or the sweep keeps it. 12 hex digits."""
    root = root or _SOURCE.parent.parent
    digest = hashlib.sha256()
    for top in TRAINING_PATH:
        path = root / top
        files = sorted(path.rglob("*")) if path.is_dir() else [path] if path.is_file() else []
        for file in files:
            name = file.relative_to(root).as_posix()
            if file.suffix not in TRAINED_SUFFIXES or name.startswith(NOT_TRAINING):
                continue
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> dict[str, Any]:
    """The vector instructions torch's CPU kernels use and whether oneDNN computes bfloat16
    natively: the two facts that decide which precision and layout are fast here (both
    honour ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY caps)."""
    return {
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


def provenance() -> dict[str, Any]:
    """The commit, machine and software of this process, for a benchmark's JSON ``meta``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    meta: dict[str, Any] = {
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {
            "cpu": cpu_model(),
            **cpu_isa(),
            "cores": cores,
            "memory_gib": _memory_gib(),
            "os": platform.platform(),
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        meta["machine"]["gpu"] = torch.cuda.get_device_name(0)
    return meta


def _memory_gib() -> float | None:
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * page_size / 2**30, 1)


def write_json(path: str | Path, records: Any, **meta: Any) -> None:
    """Write a benchmark's ``records`` as ``{"meta": provenance() | meta, "records": ...}``."""
    import json

    document = {"meta": {**provenance(), **meta}, "records": records}
    Path(path).write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwrote {path}")
