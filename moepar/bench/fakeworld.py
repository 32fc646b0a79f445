"""A process group of any size in one process, for building a rank's real model on the meta
device without the other ranks: the one place moepar touches torch's private fake backend.

Why private: torch (2.13) has no public way to give DeviceMesh and FSDP2 a world that does not
exist; `torch.testing._internal.distributed.fake_pg` registers a "fake" backend whose
collectives return at once, which is all a meta-device build needs (groups, ranks, sizes).
"""

import contextlib

import torch.distributed as dist

__all__ = ["fake_process_group"]


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """The default process group, faked, as rank `rank` of `world_size` (no other process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("a process group already exists; simulate in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
