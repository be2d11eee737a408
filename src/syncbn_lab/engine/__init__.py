"""Training engine: the loop, evaluation, optimizers and schedules, checkpoints."""

from syncbn_lab.engine.evaluate import evaluate
from syncbn_lab.engine.loop import Loaders, Trainer

__all__ = ["Loaders", "Trainer", "evaluate"]
