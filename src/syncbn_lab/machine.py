"""Facts about the machine and the launcher this process runs under."""

from __future__ import annotations

import os


def torchrun_env() -> dict[str, int] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK (and LOCAL_WORLD_SIZE) when torchrun started this process."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(k in os.environ for k in keys):
        return None
    env = {k.lower(): int(os.environ[k]) for k in keys}
    env["local_world_size"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"]))
    return env


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_INDUCTOR_BASE = "SYNCBN_LAB_INDUCTOR_CACHE_BASE"  # what the per-ISA cache dirs live under


def isolate_inductor_cache() -> str:
    """Point torch.compile's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) at a folder of its
    own for this CPU's code paths, and return it.

    Why: Inductor's cache key leaves out the CPU capability that ``ATEN_CPU_CAPABILITY`` and
    ``ONEDNN_MAX_CPU_ISA`` select, and a graph compiled under one is loaded under another:
    in torch 2.14.1, compiling the fused BN ops with ``ATEN_CPU_CAPABILITY=avx2`` and then
    natively on an AVX-512 machine aborts the process (``tests/ops/test_fused_compile.py``;
    the other way round the outputs are wrong by 2.8). Each capability then keeps its own
    cache under the base (the user's ``TORCHINDUCTOR_CACHE_DIR``, else Inductor's default),
    and a child process with other variables picks its own folder under the same base.
    """
    import torch
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get(_INDUCTOR_BASE) or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    base = os.path.abspath(base or default_cache_dir())
    isa = torch.backends.cpu.get_cpu_capability().lower()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "native").lower()
    os.environ[_INDUCTOR_BASE] = base
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"{isa}-onednn_{onednn}")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
