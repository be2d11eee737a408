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
