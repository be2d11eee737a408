"""`import syncbn_lab.nn` loads nothing of the lab: every module it brings in beyond what
`import torch` loads is the standard library's, torch's, a package torch requires, or
syncbn_lab's own. Checked in a new process of this environment, where the lab is installed
(so an import of it would succeed and show up)."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import subprocess
import sys

from torch_alone import LAB_MODULES, canonical, requirement_closure

SCRIPT = """
import json, sys
import torch
def top_level():
    return {m.split(".")[0] for m in sys.modules}
before = top_level()
import syncbn_lab.nn
print(json.dumps(sorted(top_level() - before)))
"""


def lab_module_names() -> set[str]:
    """Top-level import names that only distributions outside torch's requirements (and
    outside syncbn-lab itself) provide here: the lab's packages and any other."""
    allowed = set(requirement_closure("torch")) | {"syncbn-lab"}
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if not {canonical(d) for d in dists} & allowed
    }


def test_import_syncbn_lab_nn_loads_no_lab_package():
    lab = lab_module_names()
    assert set(LAB_MODULES) - {"pandas"} <= lab  # installed here: the check can see them
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert "syncbn_lab" in loaded
    assert not loaded & lab, f"import syncbn_lab.nn loads the lab's {sorted(loaded & lab)}"
    assert not loaded & set(LAB_MODULES), sorted(loaded & set(LAB_MODULES))
