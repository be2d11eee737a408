"""Errors a user can cause. Each carries one line that names the problem and the fix."""

import contextlib
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path


class OneLineError(Exception):
    """An error whose message is already its whole report: shown without type or traceback.

    ``exit_status`` is the process's exit status; ``reason`` goes into a multirun job's
    error.json, where the report and the sweep's progress lines read it."""

    exit_status = 1
    reason = "failed"

    def __reduce__(self):
        args = getattr(self, "init_args", self.args)
        return type(self), args, {k: v for k, v in self.__dict__.items() if k != "init_args"}


class UserError(OneLineError):
    """Bad config, data or combination: printed as one line, exit status 2, no traceback."""

    exit_status = 2


class Diverged(OneLineError):
    """The training loss stopped being finite; every rank stops at the same step."""

    reason = "diverged"

    def __init__(self, step: int, loss: float, lr: float):
        self.init_args = (step, loss, lr)  # pickled as these (a rank sends it to its parent)
        super().__init__(
            f"diverged at step {step}: the training loss is {loss} (learning rate {lr:g}); "
            "lower optim.lr, set trainer.grad_clip, or check the data"
        )
        self.step = step


class Preempted(OneLineError):
    """A stop signal (SIGTERM, SLURM's warning signal) reached the run: it saved a checkpoint
    at a step boundary and stopped. Exit status 128 + the signal, as if the signal had
    ended the process."""

    reason = "preempted"

    def __init__(self, signal_name: str, signal_number: int, step: int, checkpoint: str):
        self.init_args = (signal_name, signal_number, step, checkpoint)
        super().__init__(
            f"stopped by {signal_name} at step {step}; checkpoint {checkpoint}; continue with "
            f"trainer.resume={Path(checkpoint).parent.parent}"
        )
        self.exit_status = 128 + signal_number
        self.signal_number, self.step = signal_number, step


class OutOfMemory(OneLineError):
    """An allocation the run's config asks for was refused: the model, a batch or the data
    is larger than the memory of this machine (or GPU)."""

    reason = "out of memory"

    def __init__(self, device: str, size: str):
        self.init_args = (device, size)  # pickled as these (a rank sends it to its parent)
        super().__init__(
            f"out of memory: the {device} refused an allocation of {size}; lower model.width, "
            "trainer.global_batch_size (or raise trainer.accumulate), trainer.eval_batch_size "
            "or the data's size (data.num_train, data.image_size, ...)"
        )


@contextlib.contextmanager
def out_of_memory_is_one_line() -> Iterator[None]:
    """Inside, torch's refusal of an allocation (CPU: "can't allocate memory: you tried to
    allocate N bytes"; CUDA: ``torch.OutOfMemoryError``) becomes :class:`OutOfMemory`. An
    allocation the kernel grants and then cannot back ends the process (the OOM killer):
    no Python code sees that one."""
    try:
        yield
    except RuntimeError as e:
        message = str(e)
        if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
            found = re.search(r"Tried to allocate ([\d.]+ \w+)", message)
            raise OutOfMemory("GPU", found.group(1) if found else "memory") from None
        found = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", message)
        if found:
            raise OutOfMemory("CPU", f"{int(found.group(1)) / 1e9:,.1f} GB") from None
        raise


class ConfigError(UserError):
    """The composed config is invalid or asks for an impossible combination."""


def one_line(e: BaseException) -> str:
    """How every entry point shows ``e``: a :class:`OneLineError`'s message on one line, any
    other error as its type and the first line of its message (the rest is in the traceback)."""
    if isinstance(e, OneLineError):
        return " ".join(str(e).split())
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def say(line: str) -> None:
    """Print ``error: line`` to stderr in one write: the lines of processes that share the
    terminal (torchrun's ranks) never run into each other."""
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()


def warn_one_line(message: str, category: type[Warning] = UserWarning) -> None:
    """Issues ``message`` as a warning of ``category`` that prints as one line.

    ``warnings.warn`` prints the warning and then the source line it points at; this one
    points at no file ("syncbn_lab", line 0), so the default format is the message alone:
    ``syncbn_lab:0: UserWarning: <message>``. Filters (``-W``, ``warnings.simplefilter``,
    pytest) see an ordinary warning of ``category``; callers decide how often to warn.
    """
    warnings.warn_explicit(message, category, filename="syncbn_lab", lineno=0)
