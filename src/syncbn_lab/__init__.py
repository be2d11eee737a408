"""syncbn-lab: what data parallelism does to BatchNorm, reproduced exactly."""

__version__ = "0.1.0"


def _register_resolvers() -> None:
    """``${mul:a,b,...}`` in the configs: the product of its arguments (a study at GPU scale
    derives its global batch and learning rate from the images per GPU)."""
    import math

    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(xs), replace=True)


_register_resolvers()


def _isolate_inductor_cache() -> None:
    """torch.compile's disk cache, one folder per CPU capability (machine.py says why)."""
    from syncbn_lab.machine import isolate_inductor_cache

    isolate_inductor_cache()


_isolate_inductor_cache()
