"""This package's SyncBatchNorm where users already train: one module per framework, each
importing its framework only when it is imported itself (``integrations.lightning``)."""
