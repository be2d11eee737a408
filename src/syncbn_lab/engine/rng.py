"""Every random stream of a process, saved and restored in one place: a checkpoint keeps them
(engine.loop) and the preflight check puts them back after its trial step (engine.preflight).
Augmentation draws need none: they are a function of the batch (see data.image_dataset)."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """torch's (CPU and CUDA), Python's and NumPy's streams, in types that
    ``torch.load(weights_only=True)`` reads."""
    import numpy as np

    _, keys, position, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "python": [list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [torch.from_numpy(keys.astype("int64")), position, has_gauss, gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` saved."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    words, gauss_next = state["python"]
    random.setstate((3, tuple(words), gauss_next))
    keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype("uint32"), position, has_gauss, gauss))
