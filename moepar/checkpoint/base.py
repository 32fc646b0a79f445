"""What the other checkpoint modules share: the file names and format number, CheckpointError,
and the check that pieces tile a tensor. (The few collectives a save and a load run are the
layout's: barrier, from_rank0, gather_to_first, everyone, parallel/dims.py.)"""

import math

MANIFEST, INDEX, STATE = "manifest.json", "index.json", "state.json"
FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


# ---- pieces -----------------------------------------------------------------------------------

def volume_ok(pieces: list, shape, check_overlap: bool = True) -> bool:
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
