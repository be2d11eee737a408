"""Checkpoints: written atomically, read with torch.load(weights_only=True), checked before a
run starts.

A checkpoint holds everything a bitwise resume needs (``Trainer.state_dict``), at an epoch
boundary or within an epoch (``trainer.checkpoint_every``, a stop signal). Resuming is only
meaningful for the run that wrote it, so it records the settings that fix the run's model
and data order (:func:`resume_key`); ``trainer.resume`` with other settings, or a file that
is not such a checkpoint, is one line before anything is written.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from syncbn_lab.disk import writing
from syncbn_lab.errors import ConfigError

# What fixes the model's shapes and the order of the batches: a resume must keep them.
RESUME_KEYS = (
    "model",
    "bn.name",
    "data.name",
    "parallel.name",
    "parallel.devices",
    "trainer.global_batch_size",
    "trainer.accumulate",
    "trainer.seed",
)
REQUIRED = ("model", "optimizer", "epoch", "step", "best_val_acc")
AUTO = "auto"  # trainer.resume=auto: the run dir's own last checkpoint if any (syncbn_lab.run_dir)
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write to a temporary file in the same folder, then rename over ``path``: a full disk
    (one :class:`~syncbn_lab.disk.DiskFull` line) leaves the checkpoint before as it was."""
    run_dir = path.parent.parent
    fix = (
        f"{path.name} is kept as it was; free space there or move {run_dir} to another disk, "
        f"then continue with trainer.resume={run_dir}"
    )
    with writing(path, fix):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with writing(path, fix), os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def parse_every(value: Any) -> tuple[int | None, float | None]:
    """``trainer.checkpoint_every`` as (steps, seconds): an int N is every N optimizer steps,
    "<N>min" or "<N>s" every N minutes or seconds (rank 0's clock), null or 0 only at the end
    of each epoch."""
    if value is None or value == 0:
        return None, None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(min|s)\s*", str(value))
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(
            f"trainer.checkpoint_every={value} is not a period; use a number of steps (200), "
            "a time (10min or 90s), or null for the end of each epoch only"
        )
    seconds = float(match.group(1)) * (60 if match.group(2) == "min" else 1)
    return None, seconds


def resume_key(cfg: DictConfig) -> dict[str, Any]:
    """The settings of ``cfg`` that a resumed run must share with the run it resumes."""
    key = {}
    for path in RESUME_KEYS:
        value = OmegaConf.select(cfg, path)
        key[path] = (
            OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
        )
    return key


def resolve(resume: str, key: str = "trainer.resume") -> Path:
    """A run dir means its checkpoints/last.pt; a file is taken as it is. ``key``: the setting
    that named it, for the error message."""
    path = Path(resume).expanduser()
    if path.is_dir():
        path = path / "checkpoints" / "last.pt"
    if not path.is_file():
        raise ConfigError(
            f"{key}={resume}: no checkpoint at {path}; pass a run dir holding "
            "checkpoints/last.pt or a .pt file"
        )
    return path


def load(
    path: Path, map_location: str | torch.device = "cpu", key: str = "trainer.resume"
) -> dict[str, Any]:
    """The checkpoint at ``path``, or one ConfigError line naming ``key`` (the setting that
    named it), the file and what is wrong with it (torch's own message would advise an unsafe
    load)."""
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    if head != _ZIP_MAGIC:
        raise ConfigError(f"{key}: {path} is not a checkpoint (not a torch.save file)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except RuntimeError as e:
        if "zip archive" in str(e) or "central directory" in str(e):
            raise ConfigError(
                f"{key}: {path} is truncated or damaged ({os.path.getsize(path)} "
                "bytes); resume from an earlier checkpoint (best.pt) or start anew"
            ) from None
        raise _not_ours(path, key) from None
    except Exception:  # pickle.UnpicklingError: objects a weights-only load refuses
        raise _not_ours(path, key) from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise _not_ours(path, key)
    return state


def _not_ours(path: Path, key: str) -> ConfigError:
    return ConfigError(
        f"{key}: {path} is not a checkpoint of this project (it holds no model, "
        "optimizer and step as scripts/train.py writes them)"
    )


def check_resume(cfg: DictConfig) -> dict[str, Any] | None:
    """Load ``trainer.resume`` (None when unset) and check that this run can continue it:
    one line naming the file and the first setting that differs."""
    if not cfg.trainer.get("resume"):
        return None
    path = resolve(cfg.trainer.resume)
    state = load(path)
    saved = state.get("resume_key")
    if saved is not None:
        saved_leaves, current_leaves = _leaves(saved), _leaves(resume_key(cfg))
        for name in sorted(set(saved_leaves) | set(current_leaves)):
            was, now = saved_leaves.get(name), current_leaves.get(name)
            if was != now:
                raise ConfigError(
                    f"trainer.resume: {path} was written by a run with {name}={was}, this run "
                    f"has {name}={now}; resume with the settings the run was started with, or "
                    "start a new run without trainer.resume"
                )
    return state


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {"a.b": leaf}."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out
