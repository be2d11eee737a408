"""Communicators without an initialised process group (the distributed side is in
test_sync_dist.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from syncbn_lab.nn import LocalCommunicator, communicator_for, subgroup_for


def test_without_distributed_everything_is_local():
    assert not dist.is_initialized()
    comm = communicator_for()
    assert isinstance(comm, LocalCommunicator) and comm.world_size == 1
    t = torch.arange(3.0)
    assert comm.all_reduce_sum(t) is t and torch.equal(t, torch.arange(3.0))
    assert isinstance(communicator_for(process_group=object()), LocalCommunicator)
    assert subgroup_for(4) is None


def test_subgroup_size_must_be_positive():
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        subgroup_for(0)
