"""Where each local tensor sits in the canonical (layout-free) tensors: the map that
initialization and checkpoints use to draw, write and read shards without gathering.

Talks on no process group: pure maths on shapes, tensor-parallel specs and DTensor placements.

A local tensor (a parameter, buffer or optimizer-state shard on this rank) is a list of
`Segment`s, each a box (offsets, sizes) of one canonical tensor and the matching box of the
local tensor. How the local tensor came to be:

| step                  | local dim d ...                                  | segments                      |
|-----------------------|--------------------------------------------------|-------------------------------|
| whole dense tensor    | is canonical dim d                               | one, the whole tensor         |
| expert stack [El,...] | 0 is the local expert (canonical name by id),    | one per local expert          |
|                       | d > 0 is canonical dim d - 1                     |                               |
| tensor parallel       | along spec.dim: `chunks` blocks of this rank's   | one per block, padding cut    |
|   (TPShard)           | piece of each chunk of the (padded) tensor       |                               |
| fused tp (FusedShard) | along dim 0: this rank's piece of each part,     | per part as above, shifted    |
|                       | concatenated (qkv_proj: q, k, v heads)           | to the part's rows            |
| FSDP2 Shard(d)        | a torch.chunk of the above along d               | intersected, shifted          |
| ZeRO-1/2 flat shard   | a 1-D range of the flat bucket buffer            | contiguous boxes of each param|

`local_view(tensor, segment)` is a view of the local tensor (no copy), so init and load write
into it and save reads from it. `writes` marks the one replica of each canonical box that saves
it (replicas: dp ranks without ZeRO-3, edp ranks for experts, tp ranks for untouched tensors).
"""

import math
from dataclasses import dataclass, replace

import torch

__all__ = ["Box", "Segment", "local_view", "flat_to_boxes", "whole_segments", "tp_segments",
           "fsdp_segments", "flat_segments", "fsdp_range"]


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Segment:
    name: str                     # canonical tensor
    canon: Box                    # its region
    local: Box                    # the same region in the local tensor (or in the flat view)
    expert_dim: bool = False      # local dim 0 is the expert index (size 1 here), not canonical
    flat: tuple | None = None     # (start, shape): the local tensor is 1-D and this segment's
                                  # box lives in flat[start:start+numel].view(shape)
    writes: bool = True           # this rank saves this box (exactly one replica does)


def local_view(tensor: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The segment's box of the local tensor (a view), shaped like its canonical box."""
    if seg.flat is not None:
        start, shape = seg.flat
        tensor = tensor[start:start + math.prod(shape)].view(shape)
    for d, (offset, size) in enumerate(zip(seg.local.offsets, seg.local.sizes, strict=True)):
        tensor = tensor.narrow(d, offset, size)
    return tensor[0] if seg.expert_dim else tensor


def _canon_dim(seg: Segment, d: int) -> int | None:
    """The canonical dim of local dim d (None: the expert index)."""
    if seg.expert_dim:
        return None if d == 0 else d - 1
    return d


def _narrow(seg: Segment, d: int, start: int, stop: int, shift: int) -> Segment | None:
    """The part of seg whose local index along d is in [start, stop), with local indices moved
    by -shift; None when empty."""
    lo, size = seg.local.offsets[d], seg.local.sizes[d]
    new_lo, new_hi = max(lo, start), min(lo + size, stop)
    if new_hi <= new_lo:
        return None
    local_off, local_size = list(seg.local.offsets), list(seg.local.sizes)
    local_off[d], local_size[d] = new_lo - shift, new_hi - new_lo
    canon_off, canon_size = list(seg.canon.offsets), list(seg.canon.sizes)
    cd = _canon_dim(seg, d)
    if cd is not None:
        canon_off[cd] += new_lo - lo
        canon_size[cd] = new_hi - new_lo
    return replace(seg, local=Box(tuple(local_off), tuple(local_size)),
                   canon=Box(tuple(canon_off), tuple(canon_size)))


def whole_segments(name: str, shape: tuple, expert_names: list[str] | None = None,
                   writes: bool = True) -> list[Segment]:
    """A whole local tensor: one canonical tensor, or (expert_names) one per local expert of a
    stack [El, ...] whose expert e is canonical tensor expert_names[e]."""
    shape = tuple(shape)
    zeros = (0,) * len(shape)
    if expert_names is None:
        return [Segment(name, Box(zeros, shape), Box(zeros, shape), writes=writes)]
    rest = shape[1:]
    return [Segment(expert, Box((0,) * len(rest), rest), Box((e,) + zeros[1:], (1,) + rest),
                    expert_dim=True, writes=writes)
            for e, expert in enumerate(expert_names)]


def _fused_tp_segments(segments: list[Segment], spec, tp_rank: int) -> list[Segment]:
    """tp_segments of a FusedShard: each part's pieces, moved to the part's canonical rows and
    to its place in the local tensor."""
    out, canon_start, local_start = [], 0, 0
    d = spec.dim
    for size, local_size, part in zip(spec.sizes, spec.local_sizes, spec.parts, strict=True):
        for seg in segments:
            cd = _canon_dim(seg, d)
            sizes = list(seg.canon.sizes)
            sizes[cd] = size
            whole = replace(seg, canon=Box(seg.canon.offsets, tuple(sizes)),
                            local=Box(seg.local.offsets, tuple(sizes)))
            for piece in tp_segments([whole], part, tp_rank):
                canon_off, local_off = list(piece.canon.offsets), list(piece.local.offsets)
                canon_off[cd] += canon_start
                local_off[d] += local_start
                out.append(replace(piece, canon=Box(tuple(canon_off), piece.canon.sizes),
                                   local=Box(tuple(local_off), piece.local.sizes)))
        canon_start, local_start = canon_start + size, local_start + local_size
    return out


def tp_segments(segments: list[Segment], spec, tp_rank: int) -> list[Segment]:
    """Segments of a tensor-parallel piece (parallel/tensor.py TPShard) of whole-tensor segments.

    Along spec.dim the canonical length F is padded to Fp, cut into `chunks` blocks of Fp/chunks,
    each block into num_pieces pieces; this rank holds piece tp_rank // replicas of every block,
    concatenated. Rows in the padding have no canonical place and are dropped here. Of the
    replicas of a piece, only the first writes it (`writes`). A FusedShard (qkv_proj) is its
    parts' pieces, each part by its own TPShard."""
    if hasattr(spec, "parts"):
        return _fused_tp_segments(segments, spec, tp_rank)
    out = []
    first_holder = tp_rank % spec.replicas == 0
    piece = tp_rank // spec.replicas
    for seg in segments:
        d = spec.dim
        full = seg.canon.sizes[_canon_dim(seg, d)]
        chunk_len = (full + spec.padding) // spec.chunks
        piece_len = chunk_len // spec.num_pieces
        for block in range(spec.chunks):
            canon_start = block * chunk_len + piece * piece_len
            canon_stop = min(canon_start + piece_len, full)
            if canon_stop <= canon_start:
                continue
            local_off, local_size = list(seg.local.offsets), list(seg.local.sizes)
            local_off[d], local_size[d] = block * piece_len, canon_stop - canon_start
            canon_off, canon_size = list(seg.canon.offsets), list(seg.canon.sizes)
            canon_off[_canon_dim(seg, d)] = canon_start
            canon_size[_canon_dim(seg, d)] = canon_stop - canon_start
            out.append(replace(seg, local=Box(tuple(local_off), tuple(local_size)),
                               canon=Box(tuple(canon_off), tuple(canon_size)),
                               writes=seg.writes and first_holder))
    return out


def fsdp_range(length: int, world: int, index: int) -> tuple[int, int]:
    """[start, stop) of rank `index`'s torch.chunk of `length` rows over `world` ranks (FSDP2's
    Shard placement: chunks of ceil(length/world), trailing ranks possibly empty)."""
    chunk = -(-length // world) if length else 0
    start = min(index * chunk, length)
    return start, min(start + chunk, length)


def fsdp_segments(segments: list[Segment], dim: int, length: int, world: int,
                  index: int) -> list[Segment]:
    """The segments of rank `index`'s FSDP2 chunk along local dim `dim` of a tensor with
    `length` rows there."""
    start, stop = fsdp_range(length, world, index)
    return [s for s in (_narrow(seg, dim, start, stop, start) for seg in segments) if s]


def flat_to_boxes(shape: tuple, start: int, stop: int) -> list[tuple[int, Box]]:
    """The flat (row-major) element range [start, stop) of a tensor of `shape` as boxes, each
    contiguous in memory: [(flat offset of the box's first element, box)], in order."""
    shape = tuple(shape)
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [(start, Box((start,), (stop - start,)))] if shape else [(0, Box((), ()))]
    row = math.prod(shape[1:])
    first, col0 = divmod(start, row)
    last, col1 = divmod(stop, row)

    def within(r: int, a: int, b: int):
        return [(r * row + off, Box((r,) + box.offsets, (1,) + box.sizes))
                for off, box in flat_to_boxes(shape[1:], a, b)]

    if first == last:
        return within(first, col0, col1)
    out = within(first, col0, row) if col0 else []
    full_from = first + (1 if col0 else 0)
    if last > full_from:
        out.append((full_from * row, Box((full_from,) + (0,) * (len(shape) - 1),
                                         (last - full_from,) + shape[1:])))
    if col1:
        out += within(last, 0, col1)
    return out


def flat_segments(param_segments: list[Segment], shape: tuple, param_offset: int, lo: int,
                  hi: int) -> list[Segment]:
    """Segments of the part of a parameter (of local `shape`, at `param_offset` in a flat bucket)
    inside this rank's flat shard [lo, hi) of the bucket: views into the 1-D shard tensor."""
    numel = math.prod(shape)
    a, b = max(lo, param_offset) - param_offset, min(hi, param_offset + numel) - param_offset
    out = []
    for flat_start, box in flat_to_boxes(shape, a, b):
        for seg in param_segments:
            part = seg
            for d in range(len(shape)):
                part = part and _narrow(part, d, box.offsets[d], box.offsets[d] + box.sizes[d],
                                        box.offsets[d])
            if part is not None:
                out.append(replace(part, flat=(param_offset + flat_start - lo, box.sizes)))
    return out
