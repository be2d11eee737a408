"""A run that trained before a config key existed reads, in a report's cells, the default the
experiment now gives that key (the default that keeps the old behaviour); a run that records
the key keeps its own value."""

from dataclasses import replace

from omegaconf import OmegaConf

from syncbn_lab.report.cells import Cells
from syncbn_lab.report.collect import Run
from syncbn_lab.report.spec import spec_of


def run_with(tmp_path, name, data):
    run_dir = tmp_path / name
    run_dir.mkdir()
    OmegaConf.save(OmegaConf.create({"data": data}), run_dir / "config.yaml")
    return Run(run_dir, {"seed": 0, "bn": "bn"})


def test_a_key_added_since_the_run_trained_reads_the_experiments_default(tmp_path):
    spec = replace(spec_of("nbs_heterogeneity"), cells=("data.heterogeneity",))
    old = run_with(tmp_path, "old", {"name": "fashion_mnist"})
    new = run_with(tmp_path, "new", {"name": "fashion_mnist", "heterogeneity": 0.9})
    cells = Cells(spec, [old, new])
    assert old.lacks("data.heterogeneity") and not new.lacks("data.heterogeneity")
    assert old.value("data.heterogeneity") is None  # results.csv records what the run did
    assert cells.value(old, "data.heterogeneity") == OmegaConf.select(
        spec.config, "data.heterogeneity"
    )
    assert cells.value(new, "data.heterogeneity") == 0.9
    assert not old.lacks("seed")  # a summary key is never "added since"
