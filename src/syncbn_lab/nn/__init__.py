"""BatchNorm math and layers: per-device BN, SyncBN over any communicator, Batch
Renormalization, a GroupNorm for channels_last on CPU, conversion helpers, and the Joinable
step for uneven inputs under DDP.

``functional.batch_norm`` is the reference (hand-written forward and backward);
``BatchNorm``/``SyncBatchNorm`` are the modules; ``comm`` holds the communicators that are the
only difference between real DDP and the single-process emulation of N devices.
"""

from syncbn_lab.nn.batch_renorm import BatchRenorm
from syncbn_lab.nn.comm import (
    Communicator,
    LocalCommunicator,
    ProcessGroupCommunicator,
    communicator_for,
    subgroup_for,
)
from syncbn_lab.nn.convert import (
    convert_sync_batchnorm,
    register_batchnorm_subclass,
    revert_sync_batchnorm,
)
from syncbn_lab.nn.functional import batch_norm
from syncbn_lab.nn.group_norm import GroupNorm
from syncbn_lab.nn.join import JoinableStep
from syncbn_lab.nn.sync_batchnorm import (
    BatchNorm,
    SyncBatchNorm,
    SyncBatchNormAct,
    is_sync_batchnorm,
)

__all__ = [
    "BatchNorm",
    "BatchRenorm",
    "Communicator",
    "GroupNorm",
    "JoinableStep",
    "LocalCommunicator",
    "ProcessGroupCommunicator",
    "SyncBatchNorm",
    "SyncBatchNormAct",
    "batch_norm",
    "communicator_for",
    "convert_sync_batchnorm",
    "is_sync_batchnorm",
    "register_batchnorm_subclass",
    "revert_sync_batchnorm",
    "subgroup_for",
]
