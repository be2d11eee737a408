"""A run whose per-device BN normalises over 4 or fewer images says so in one line at its start,
quoting the committed capacity report's figure and a SyncBN group that spans 32 images."""

import re
from pathlib import Path

import pytest

from syncbn_lab.train import run
from syncbn_lab.variants import SMALL_BATCH_FIGURE, variant

ROOT = Path(__file__).resolve().parents[2]


def test_the_note_quotes_the_committed_capacity_penalty_at_width_4():
    report = (ROOT / "reports" / "nbs_capacity" / "README.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| model.width=4,"))
    penalty = row.strip("|").split("|")[2].split(" ± ")[0].strip()
    assert f"cost {penalty} pp of test error" in SMALL_BATCH_FIGURE
    # width 16 (nbs_256): within the noise, as the note says
    nbs = (ROOT / "reports" / "nbs_256" / "README.md").read_text()
    assert re.search(r"\+0\.14 ± 0\.18", nbs)


@pytest.mark.parametrize(
    ("name", "batch", "devices", "setting"),
    [
        ("bn", 2, 128, "bn=sync bn.group_size=16 (statistics over 32 images)"),
        ("bn", 4, 8, "bn=sync bn.group_size=8 (statistics over 32 images)"),
        ("bn", 3, 6, "bn=sync (statistics over 18 images)"),
        ("bn", 4, 1, "a larger trainer.global_batch_size or bn=gn"),
        ("bn", 5, 128, None),
        ("sync", 2, 128, None),
        ("gn", 1, 128, None),
    ],
)
def test_the_note_names_a_sync_group_that_spans_32_images(name, batch, devices, setting):
    note = variant(name).small_batch_note(batch, devices)
    if setting is None:
        assert note is None
    else:
        assert note.startswith(f"note: per-device BN normalises over {batch} image(s) here")
        assert note.endswith(setting) and "\n" not in note


def test_a_run_at_2_images_per_device_prints_the_note_once(tmp_path, tiny_cfg, capsys):
    run(tiny_cfg("parallel=emulated", "parallel.devices=16", "trainer.max_steps=1"), tmp_path)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: per-device")]
    assert lines == [variant("bn").small_batch_note(2, 16)]
    assert lines[0] in (tmp_path / "train.log").read_text()
