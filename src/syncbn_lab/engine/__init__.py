"""Training engine: the loop (engine.loop), evaluation, optimizers and schedules, checkpoints,
preemption. The package imports none of them, so that parallel/ddp.py can use
engine.preemption without loading the loop (which imports parallel/): no import cycle."""
