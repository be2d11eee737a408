import pytest
import torch

from syncbn_lab.engine import checkpoint
from syncbn_lab.errors import ConfigError


def test_save_is_atomic_and_loads_weights_only(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    state = {"model": {"w": torch.arange(4.0)}, "step": 3}
    checkpoint.save_atomic(state, path)
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temporary left
    loaded = checkpoint.load(path)
    torch.testing.assert_close(loaded["model"]["w"], state["model"]["w"])


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    checkpoint.save_atomic({"step": 1}, path)

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save_atomic({"step": 2}, path)
    assert checkpoint.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_resolve_run_dir_and_errors(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    checkpoint.save_atomic({"step": 1}, run / "checkpoints" / "last.pt")
    assert checkpoint.resolve(str(run)) == run / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError, match="no checkpoint at"):
        checkpoint.resolve(str(tmp_path / "missing"))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read checkpoint"):
        checkpoint.load(bad)
