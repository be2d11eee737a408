"""How a training step computes, apart from its precision: memory layout and compilation.

- ``trainer.channels_last``: the model's 4-D parameters and every input batch in
  ``torch.channels_last`` (NHWC). oneDNN's convolutions run faster in it on a CPU, and the
  fused norm kernels keep the layout they are given, so no layer converts back.
- ``trainer.compile``: the training forward (and its backward, through AOTAutograd) goes
  through ``torch.compile``. A one-process run (single, emulated) compiles one graph
  (``fullgraph=True``): the norm ops of ``syncbn_lab._C`` are torch.library ops with fake
  kernels, so the graph holds them whole. Under DDP the graph may not be one: Dynamo's
  DDPOptimizer splits it at DDP's gradient buckets so that each bucket's all_reduce starts
  while the rest of the backward runs, and SyncBN's collectives stay in the graph between.
  Evaluation runs eagerly on the unwrapped module: it is a small share of a run and would
  otherwise compile a graph per evaluation batch size.

Neither changes what is computed: channels_last and compilation reorder float32 sums at
most (``reports/fast_vs_fp32/`` measures it next to the noise floor); bf16 autocast is
``trainer.precision``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from syncbn_lab.errors import ConfigError


def memory_format(channels_last: bool) -> torch.memory_format:
    """The layout of parameters and input batches for ``trainer.channels_last``."""
    return torch.channels_last if channels_last else torch.preserve_format


def to_device(images: torch.Tensor, device: torch.device, layout: torch.memory_format):
    """An input batch on ``device`` in ``layout`` (a no-op copy-wise when it already is)."""
    if images.dim() != 4:
        layout = torch.preserve_format
    return images.to(device, non_blocking=True, memory_format=layout)


def compile_model(model: nn.Module, fullgraph: bool = True) -> Callable:
    """``model`` compiled, as one graph where ``fullgraph`` (a DDP model: False); a failure
    surfaces at its first call (see :func:`compile_error`)."""
    return torch.compile(model, fullgraph=fullgraph, dynamic=False)


def compile_counts() -> dict[str, int]:
    """Dynamo's counts in this process so far: frames compiled to graphs (``unique_graphs``)
    and recompilations (a guard that failed on a later call)."""
    from torch._dynamo.utils import counters

    return {
        "compile_graphs": counters["stats"]["unique_graphs"],
        "compile_recompiles": sum(counters["recompiles"].values()),
    }


def compile_error(error: BaseException) -> ConfigError | None:
    """The one-line error for an exception raised while compiling, or None for any other."""
    from torch._dynamo.exc import TorchDynamoException

    if not isinstance(error, TorchDynamoException):
        return None
    reason = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return ConfigError(
        f"trainer.compile=true failed to compile the model ({type(error).__name__}: "
        f"{reason[:300]}); run with trainer.compile=false"
    )
