"""What the other checkpoint modules share: the file names and format number, CheckpointError,
the few collectives a save and a load run, and the check that pieces tile a tensor."""

import math

import torch.distributed as dist

MANIFEST, INDEX, STATE = "manifest.json", "index.json", "state.json"
FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


# ---- ranks ------------------------------------------------------------------------------------

def _world(layout) -> int:
    return layout.dims.world_size if layout.meshes is not None else 1


def _barrier(layout):
    if _world(layout) > 1:
        dist.barrier()


def _gather_to_first(layout, obj) -> list | None:
    """Every rank's obj on rank 0 (None elsewhere)."""
    if _world(layout) == 1:
        return [obj]
    out = [None] * _world(layout) if layout.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _everyone(layout, obj) -> list:
    if _world(layout) == 1:
        return [obj]
    out = [None] * _world(layout)
    dist.all_gather_object(out, obj)
    return out


def _broadcast(layout, obj):
    if _world(layout) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- pieces -----------------------------------------------------------------------------------

def _volume_ok(pieces: list, shape, check_overlap: bool = True) -> bool:
    """The pieces tile a tensor of `shape`: inside it, pairwise disjoint, volumes summing up.
    (The pairwise test is quadratic: readers skip it for tensors cut into very many pieces,
    where inside-and-summing-up still refuses a damaged index.)"""
    boxes = [(p["offsets"], p["sizes"]) for p in pieces]
    for offsets, sizes in boxes:
        if len(offsets) != len(shape) or any(o < 0 or o + n > d for o, n, d in
                                             zip(offsets, sizes, shape)):
            return False
    for i, (a_off, a_size) in enumerate(boxes if check_overlap else []):
        for b_off, b_size in boxes[i + 1:]:
            if all(max(ao, bo) < min(ao + an, bo + bn)
                   for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size)):
                return False
    return sum(math.prod(s) for _, s in boxes) == math.prod(shape)
