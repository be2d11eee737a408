"""Parallel modes: single device, an exact emulation of N devices, DDP and DataParallel."""

from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.launch import launch

__all__ = ["Runtime", "launch"]
