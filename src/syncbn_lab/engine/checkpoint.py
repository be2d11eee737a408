"""Checkpoints written atomically and read with torch.load(weights_only=True)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from syncbn_lab.errors import ConfigError


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write to a temporary file in the same folder, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def resolve(resume: str) -> Path:
    """A run dir means its checkpoints/last.pt; a file is taken as it is."""
    path = Path(resume).expanduser()
    if path.is_dir():
        path = path / "checkpoints" / "last.pt"
    if not path.is_file():
        raise ConfigError(
            f"trainer.resume={resume}: no checkpoint at {path}; pass a run dir holding "
            "checkpoints/last.pt or a .pt file"
        )
    return path


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise ConfigError(f"cannot read checkpoint {path} ({type(e).__name__}: {e})") from e
