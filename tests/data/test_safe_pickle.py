"""The restricted unpickler refuses code and still reads numpy arrays written by any protocol."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest

from syncbn_lab.data import DataError
from syncbn_lab.data.safe_pickle import safe_load


class _RunsShell:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_refuses_a_pickle_that_would_call_os_system(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"data": _RunsShell(str(marker))}, protocol=2)
    # Sanity check of the payload itself: plain pickle would run the command.
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(DataError, match=r"global (posix|os|nt)\.system") as info:
        safe_load(io.BytesIO(payload), source="evil.pkl")
    assert "evil.pkl" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("builtins", "eval"),
        ("subprocess", "Popen"),
        ("numpy", "load"),
        ("numpy.testing", "assert_"),
    ],
)
def test_refuses_any_other_global(module, name):
    payload = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"q\x00."
    with pytest.raises(DataError, match=rf"{module}\.{name}"):
        safe_load(io.BytesIO(payload))


def test_codecs_encode_is_limited_to_latin1():
    payload = b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x05\x00\x00\x00rot13\x86R."
    with pytest.raises(DataError, match="rot13"):
        safe_load(io.BytesIO(payload))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_reads_numpy_arrays_and_containers(protocol):
    obj = {
        "x": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4),
        b"data": np.arange(256, dtype=np.uint8),
        "labels": [3, 1, 2],
        "y": np.array([7, -1], dtype=np.int64),
        "scalar": np.float64(0.5),
        "names": ("a", "b"),
    }
    out = safe_load(io.BytesIO(pickle.dumps(obj, protocol=protocol)))
    assert set(out) == set(obj)
    for key in ("x", b"data", "y"):
        assert out[key].dtype == obj[key].dtype
        np.testing.assert_array_equal(out[key], obj[key])
    assert out["labels"] == [3, 1, 2] and out["names"] == ("a", "b") and out["scalar"] == 0.5


def test_garbage_is_a_data_error():
    with pytest.raises(DataError, match="not a readable pickle"):
        safe_load(io.BytesIO(b"\x80\x02this is not a pickle"), source="junk.pkl")
