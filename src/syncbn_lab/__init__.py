"""syncbn-lab: what data parallelism does to BatchNorm, reproduced exactly.

``syncbn_lab.nn`` (the layers) needs torch alone; the lab around it (configs, training,
reports) needs the ``lab`` extra.
"""

import sys

__version__ = "0.1.0"

# The configs' resolvers: registered by syncbn_lab.config when it loads, and here already
# when OmegaConf is loaded (a Hydra entry point may resolve a config before that). Importing
# the package never loads OmegaConf itself, so `import syncbn_lab.nn` needs torch alone.
if "omegaconf" in sys.modules:
    import syncbn_lab.resolvers  # noqa: F401


def _isolate_inductor_cache() -> None:
    """torch.compile's disk cache, one folder per CPU capability (machine.py says why)."""
    from syncbn_lab.machine import isolate_inductor_cache

    isolate_inductor_cache()


_isolate_inductor_cache()
