"""A run whose per-device BN normalises over 4 or fewer images says so in one line at its start,
quoting the committed combined report's figures and a SyncBN group that spans 32 images."""

import re
from pathlib import Path

import pytest

from syncbn_lab.train import run
from syncbn_lab.variants import SMALL_BATCH_FIGURE, variant

ROOT = Path(__file__).resolve().parents[2]


def test_the_note_quotes_the_committed_combined_report():
    report = (ROOT / "reports" / "nbs_penalty" / "README.md").read_text()
    claim = re.search(r"appears in (\d+) of the (\d+) configurations", report)
    assert f"in {claim.group(1)} of the {claim.group(2)} configurations" in SMALL_BATCH_FIGURE
    quoted_rows = (
        ("fashion_mnist, resnet8, width 4,", "{} pp for resnet8 at width 4 on Fashion-MNIST"),
        ("animal_mnist, resnet8, width 2,", "{} pp at width 2 on Animal-MNIST"),
    )
    for config, quoted in quoted_rows:
        row = next(line for line in report.splitlines() if line.startswith(f"| {config}"))
        penalty = row.strip("|").split("|")[2].split(" ± ")[0].strip()
        assert quoted.format(penalty) in SMALL_BATCH_FIGURE, config
    verdict = "does not hold for any of the 5 candidates"
    assert verdict in report and "no figure of a run predicted which" in SMALL_BATCH_FIGURE


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
