"""Gradients across ranks: which group reduces each one, the plain step-end reduction, the
global gradient norm and clipping (the gradient syncs, ddp.py and zero.py, build on these).

Talks on `dp` (dense gradients, step statistics), `edp` (expert gradients) and `ep` (the norm).

| parameters                      | reduced over | how                      |
|---------------------------------|--------------|--------------------------|
| dense (everything not experts)  | dp (x cp)    | sum, / dp  (a mean)      |
| experts (GroupedExperts)        | edp          | sum, / dp  (see expert.py)|

Which group reduces a parameter is decided by the module that owns it (`GroupedExperts` or
not), never by attributes on the parameter. Each group's gradients travel flattened into one
buffer. Training overlaps the same reduction with backward (ddp.py); `reduce_gradients` is its
plain step-end form, kept as the reference the overlapped one is tested against.
"""

import math
import struct
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.utils import get_total_norm

from moepar.layers.experts import GroupedExperts

__all__ = ["split_parameters", "reduce_gradients", "grad_norm", "clip_coefficient",
           "clip_gradients", "all_reduce_sum", "grad_norm_groups", "Rows", "rows_of"]


class Rows(NamedTuple):
    """Rows [start, stop) of a parameter's dim 0: a part of one parameter that is replicated
    differently from the rest (tensor.py: the k and v rows of a fused qkv_proj whose kv heads are
    shared by several tp ranks). Gradient syncs' grad_view(param, (start, stop)) find its
    gradient wherever it lives."""
    param: torch.nn.Parameter
    start: int
    stop: int

    @property
    def grad(self):
        """The rows of param.grad (a view), or None."""
        g = self.param.grad
        return None if g is None else g[self.start:self.stop]


def rows_of(grad, rows):
    """grad[start:stop] for rows (start, stop); grad itself for None (or a None grad)."""
    return grad if grad is None or rows is None else grad[rows[0]:rows[1]]


def _grad_of(sync, p):
    if isinstance(p, Rows):
        return sync.grad_view(p.param, (p.start, p.stop))
    return sync.grad_view(p)


def split_parameters(model):
    """(dense parameters, expert parameters), by owning module type."""
    expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts)
                  for p in m.parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    experts = [p for p in model.parameters() if id(p) in expert_ids]
    return dense, experts


def all_reduce_sum(tensors: list[torch.Tensor], group, scale: float = 1.0):
    """Sums the tensors over `group` in place through one flat buffer, then multiplies by scale."""
    if not tensors:
        return
    if group is None or dist.get_world_size(group) == 1:
        if scale != 1.0:
            for t in tensors:
                t.mul_(scale)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def reduce_gradients(model, meshes, dims):
    """Dense grads averaged over dp; expert grads summed over edp and divided by dp.

    The plain, step-end form: training uses the overlapped reducer in ddp.py, which tests check
    against this one.
    """
    if meshes is None:
        return
    dense, experts = split_parameters(model)
    for params, axis in ((dense, dims.dense_data_axis), (experts, "edp")):
        grads = [p.grad for p in params if p.grad is not None]
        all_reduce_sum(grads, meshes.group(axis), 1.0 / dims.dp)


def grad_norm_groups(model, sync, dims, tp_split=None):
    """The [(gradients, axes)] groups for `grad_norm` and `clip_gradients` in any layout.

    `sync` tells where each gradient lives (`grad_view`) and over which axes that storage is
    sharded (ZeRO: dense over dp, experts over edp). On top: experts differ over ep; tensor-
    parallel shards differ over tp (`tp_split` = (sharded, replicated, scale_only) dense
    parameters; scale_only are extra replicas of a shard, clipped but not counted); pipeline
    stages hold disjoint parameters (pp)."""
    dense, experts = split_parameters(model)
    sharded, replicated, scale_only = tp_split or ([], dense, [])
    pp = ("pp",) if dims is not None and dims.pp > 1 else ()

    def views(params):
        return [g for g in (_grad_of(sync, p) for p in params) if g is not None]

    return [(views(replicated), sync.dense_axes + pp),
            (views(sharded), sync.dense_axes + ("tp",) + pp),
            (views(experts), sync.expert_axes + ("ep",) + pp),
            (views(scale_only), None)]


_AXIS_ORDER = ("dp", "dp_cp", "edp", "ep", "tp", "pp")


def grad_norm(groups, meshes, device=None) -> torch.Tensor:
    """Global L2 norm (float64, left on the device: no sync) of all gradients.

    `groups` is [(this rank's gradient tensors, axes)]: the squares of a group are summed over
    its axes. Replicated gradients name no axis for their replicas (counted once); sharded ones
    name the axes they are sharded over (every shard counted); axes None: clipped, not counted.
    Every rank passes the same group structure, so the all-reduces (one per axis) line up.
    """
    grads = [g for group, _ in groups for g in group]
    device = device or (grads[0].device if grads else torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float64, device=device)
    # One 0-d tensor per group, combined with stack and integer views: no Python-list indexing
    # of device tensors (each would be a host-to-device copy of the indices).
    squares = [get_total_norm(group).double().square() if group and axes is not None else zero
               for group, axes in groups]
    if meshes is not None:
        for axis in _AXIS_ORDER:
            rows = [i for i, (_, axes) in enumerate(groups) if axes and axis in axes]
            if rows:
                part = torch.stack([squares[i] for i in rows])
                all_reduce_sum([part], meshes.group(axis))
                for j, i in enumerate(rows):
                    squares[i] = part[j]
    return torch.stack(squares).sum().sqrt()


def _float32(x: float) -> float:
    """x rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def clip_coefficient(norm: float, max_norm: float, dtype: torch.dtype) -> float | None:
    """The factor that brings gradients of global norm `norm` (read on the host) down to
    max_norm, or None when they are within it (or the norm is not finite: the step is skipped).

    The value torch's clipping computes on the device, max_norm / (norm + 1e-6) in the
    gradients' dtype, reproduced exactly on the host: float32 operations done in double and
    rounded once are correctly rounded (53 >= 2 * 24 + 2 bits), so the gradients come out
    bit-identical to multiplying by the device coefficient."""
    if not (math.isfinite(max_norm) and math.isfinite(norm)):
        return None
    if dtype == torch.float64:
        coef = (1.0 / (norm + 1e-6)) * max_norm
    elif dtype == torch.float32:
        coef = _float32(_float32(1.0 / _float32(_float32(norm) + _float32(1e-6)))
                        * _float32(max_norm))
    else:
        raise ValueError(f"gradients are clipped in float32 or float64, not {dtype}")
    return coef if coef < 1.0 else None


def clip_gradients(groups, norm: float, max_norm: float) -> bool:
    """Multiplies every gradient of `groups` by the clip coefficient when `norm` (the global
    norm, from the step's host sync) is over max_norm; True if it did. A step within the limit
    touches no gradient (the old clamped multiply by 1 read and wrote them all)."""
    grads = [g for group, _ in groups for g in group]
    coef = clip_coefficient(norm, max_norm, grads[0].dtype) if grads else None
    if coef is None:
        return False
    torch._foreach_mul_(grads, coef)
    return True
