"""syncbn-lab: what data parallelism does to BatchNorm, reproduced exactly."""

__version__ = "0.1.0"
