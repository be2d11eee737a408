"""docs/architecture.md cites only paths and names that exist."""

from __future__ import annotations

import importlib
import re

from conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"(?<![\w/.])((?:src|configs|scripts|tests|docs|csrc)/[\w./-]*)")
DOTTED = re.compile(r"\b(syncbn_lab(?:\.\w+)+)")
CALLED = re.compile(r"(?<![\w.])((?:[a-z_]+\.)+[A-Za-z_]+)\(")  # in the data flow: pkg.mod.f(


def cited_names(text: str) -> set[str]:
    """``syncbn_lab.…`` anywhere, and the package-relative calls of the code blocks."""
    names = set(DOTTED.findall(text))
    for block in text.split("```")[1::2]:
        names |= {n if n.startswith("syncbn_lab.") else f"syncbn_lab.{n}"
                  for n in CALLED.findall(block)}  # fmt: skip
    return names


def cited_paths(text: str) -> set[str]:
    return {m.rstrip(".") for m in PATH.findall(text)}


def resolve(dotted: str) -> object:
    """The object ``syncbn_lab.a.b.C.d`` names: the longest importable module, then
    attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_scan_finds_what_the_doc_cites():
    text = "see `src/a.py`, configs/bn/ and `syncbn_lab.x.y`; not path/src/b.py"
    assert cited_paths(text) == {"src/a.py", "configs/bn/"}
    block = "```\n  -> pkg.mod.f(cfg.data)  worker(rt)  a.b\n```"
    assert cited_names(text + block) == {"syncbn_lab.x.y", "syncbn_lab.pkg.mod.f"}


def test_every_cited_path_exists():
    paths = cited_paths(DOC.read_text())
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing


def test_every_cited_name_exists():
    names = cited_names(DOC.read_text())
    assert len(names) > 20
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, missing
