"""docs/parallel.md shows scripts/slurm_torchrun.sbatch as it is (the script a cluster test
submits), so the worked example cannot drift from the tested one."""

from conftest import ROOT


def test_the_documented_sbatch_script_is_the_tested_one():
    script = (ROOT / "scripts" / "slurm_torchrun.sbatch").read_text().splitlines()
    first_option = next(i for i, line in enumerate(script) if line.startswith("#SBATCH"))
    expected = [script[0], *script[first_option:]]  # without the header comment
    doc = (ROOT / "docs" / "parallel.md").read_text()
    shown = "#!/bin/bash\n" + doc.split("```bash\n#!/bin/bash\n", 1)[1].split("\n```", 1)[0]
    assert shown.splitlines() == expected
