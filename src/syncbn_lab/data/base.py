"""Types shared by every dataset family: the error users see and the split bundle."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch.utils.data import Dataset

from syncbn_lab.errors import UserError


class DataError(UserError):
    """A problem with data the user can fix; the message is one line saying what and how."""


@dataclass
class DataSplits:
    """The three splits of one dataset plus the shape facts a model needs."""

    train: Dataset
    val: Dataset
    test: Dataset
    num_classes: int
    in_channels: int
    image_size: int


def require(cfg: DictConfig, key: str) -> Any:
    """``cfg[key]``, or a DataError naming the config file that should define it."""
    if key not in cfg or cfg[key] is None:
        name = cfg.get("name", "<name>")
        raise DataError(
            f"data.{key} is not set; add it to configs/data/{name}.yaml or pass data.{key}=..."
        )
    return cfg[key]


def resolve_root(root: str | os.PathLike) -> Path:
    """Expand ``~`` and make ``root`` absolute against the directory the run was launched from.

    Inside a Hydra run with ``hydra.job.chdir=true`` that is Hydra's original working directory,
    so ``root: data`` keeps pointing at the repository's ``data/`` folder.
    """
    path = Path(os.path.expanduser(str(root)))
    if path.is_absolute():
        return path
    from hydra.utils import to_absolute_path

    return Path(to_absolute_path(str(path)))
