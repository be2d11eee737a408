"""Parallel modes: single device, an exact emulation of N devices, DDP and DataParallel."""

from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.modes import parallelize
from syncbn_lab.parallel.wrap import Parallel

__all__ = ["Parallel", "Runtime", "parallelize"]
