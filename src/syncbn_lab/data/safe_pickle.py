"""Read numpy-array pickles (MNIST's mnist.pkl.gz, CIFAR's batches) without running their code.

``pickle.load`` executes whatever callable a file names, so a tampered data file could run
``os.system``. :class:`RestrictedUnpickler` resolves only the few globals that rebuilding numpy
arrays needs; plain containers, numbers, strings and bytes need no globals at all.
"""

from __future__ import annotations

import codecs
import pickle
from typing import IO, Any

import numpy as np

from .base import DataError


def _numpy_core() -> Any:
    try:
        from numpy._core import multiarray, numeric  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray, numeric
    return multiarray, numeric


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as Python 3 uses it to store bytes in protocol-2 pickles, latin1 only."""
    if codecs.lookup(encoding).name != "iso8859-1":
        raise DataError(f"a data pickle asked for _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    multiarray, numeric = _numpy_core()
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    # Pickles name the module that wrote them: numpy.core (numpy 1.x) or numpy._core (numpy 2).
    for module in ("numpy.core", "numpy._core"):
        allowed[(f"{module}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{module}.multiarray", "scalar")] = multiarray.scalar
        # Protocol-5 pickles of arrays (what numpy writes by default today) use _frombuffer.
        allowed[(f"{module}.numeric", "_frombuffer")] = numeric._frombuffer
    # Python 3 writes the raw buffer of an array as _codecs.encode(str, "latin1") at protocol 2.
    allowed[("_codecs", "encode")] = _latin1_encode
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler whose ``find_class`` admits only what numpy arrays need.

    Anything else raises :class:`DataError` naming the refused global.
    """

    def __init__(self, file: IO[bytes], *, source: str = "pickle", **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._source = source
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise DataError(
                f"{self._source} refers to the global {module}.{name}, which a data file must not "
                "use (only numpy arrays are allowed); it is not genuine, delete it and fetch it "
                "again"
            ) from None


def safe_load(file: IO[bytes], *, source: str = "pickle") -> Any:
    """Unpickle numpy arrays and plain containers from ``file``; Python-2 strings as latin1.

    latin1 maps each byte of a Python-2 ``str`` to one character, which is also what numpy
    needs to rebuild the raw array buffers that Python 2 stored as ``str``.
    """
    try:
        return RestrictedUnpickler(file, source=source, encoding="latin1").load()
    except DataError:
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
    ) as exc:
        raise DataError(
            f"{source} is not a readable pickle ({exc}); delete it and fetch it again"
        ) from exc
