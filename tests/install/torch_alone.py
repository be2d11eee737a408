"""An environment with torch alone, made from this one: the distributions torch requires
(from their metadata) and links to their installed files. tests/install/ uses it."""

from __future__ import annotations

import importlib.metadata as metadata
import re
from pathlib import Path, PurePosixPath

from packaging.requirements import Requirement

# Import names of the lab's packages (the `lab` extra and what it brings), none of which the
# library may need. numpy too: torch does not require it, and syncbn_lab.nn does not use it.
LAB_MODULES = (
    "hydra",
    "omegaconf",
    "wandb",
    "matplotlib",
    "scipy",
    "sklearn",
    "tqdm",
    "pandas",
    "torchvision",
    "numpy",
    "yaml",
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(name: str) -> dict[str, metadata.Distribution]:
    """The installed distributions ``name`` needs, itself included, by canonical name:
    its requirements whose markers hold here (with the extras asked for), recursively."""
    found: dict[str, metadata.Distribution] = {}
    todo = [(name, frozenset())]
    while todo:
        dist_name, extras = todo.pop()
        if canonical(dist_name) in found:
            continue
        dist = metadata.distribution(dist_name)
        found[canonical(dist_name)] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return found


def link_distributions(keep: dict[str, metadata.Distribution], dest: Path) -> None:
    """Links every file of the distributions in ``keep`` (their RECORDs) into ``dest``, at the
    same relative paths: a whole folder where only they own files under it (torch/), the
    parts they own where others share it too (a namespace package such as nvidia/)."""
    site = Path(next(iter(keep.values())).locate_file(""))
    owners: dict[PurePosixPath, set[str]] = {}  # a file or folder -> the distributions in it
    children: dict[PurePosixPath, set[PurePosixPath]] = {}
    for dist in metadata.distributions(path=[str(site)]):
        name = canonical(dist.metadata["Name"])
        for file in dist.files or []:
            path = PurePosixPath(file)
            if path.parts[0] == "..":  # scripts in bin/: not needed to import
                continue
            while path.parts:
                owners.setdefault(path, set()).add(name)
                children.setdefault(path.parent, set()).add(path)
                path = path.parent

    def link(path: PurePosixPath) -> None:
        if owners[path] <= keep.keys():
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(site / path)
            return
        for child in sorted(children.get(path, ())):
            if owners[child] & keep.keys():
                link(child)

    for top in sorted(children[PurePosixPath(".")]):
        if owners[top] & keep.keys():
            link(top)
