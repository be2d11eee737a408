"""Without the extension the package still imports, says so once, and the ops raise clearly."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("always")
    from syncbn_lab.nn import _ext, ops
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _ext.available() is False
        assert _ext.available() is False
        assert ops.available() is False
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    print(messages[0])
    try:
        ops.local_stats(__import__("torch").zeros(2, 3))
    except RuntimeError as error:
        print("raised:", error)
    """
)


def test_missing_extension_warns_once_and_ops_raise():
    env = dict(os.environ, SYNCBN_LAB_EXT="0")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.strip().splitlines()[-2:]
    assert first == (
        "syncbn_lab._C is not built (disabled by SYNCBN_LAB_EXT=0); using the reference "
        "implementation. Build it with `make build-ext`."
    )
    assert second.startswith("raised: syncbn_lab._C is not built")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF dynamic section: Linux")
@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_built_module_links_libstdcxx_shared():
    """A module with its own static libstdc++ crashed on every C++ exception (TORCH_CHECK) on
    a CUDA image whose g++ wrapper linked it so; setup.py links it shared, as torch does."""
    from syncbn_lab.nn import _ext

    if not _ext.load():
        pytest.skip("syncbn_lab._C is not built")
    module = importlib.import_module("syncbn_lab._C").__file__
    dynamic = subprocess.run(["readelf", "-d", module], capture_output=True, text=True, check=True)
    assert "libstdc++.so" in dynamic.stdout, dynamic.stdout
