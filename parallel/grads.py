"""Gradients across ranks: which group reduces each one, the plain step-end reduction, the
global gradient norm and clipping (the gradient syncs, ddp.py and zero.py, build on these).

Talks on `dp` (dense gradients, step statistics), `edp` (expert gradients) and `ep` (the norm).

| parameters                      | reduced over | how                      |
|---------------------------------|--------------|--------------------------|
| dense (everything not experts)  | dp           | sum, / dp  (a mean)      |
| experts (GroupedExperts)        | edp          | sum, / dp  (see expert.py)|

Which group reduces a parameter is decided by the module that owns it (`GroupedExperts` or
not), never by attributes on the parameter. Each group's gradients travel flattened into one
buffer. Training overlaps the same reduction with backward (ddp.py); `reduce_gradients` is its
plain step-end form, kept as the reference the overlapped one is tested against.
"""

import math

import torch
import torch.distributed as dist
from torch.nn.utils import get_total_norm

from moepar.layers.experts import GroupedExperts

__all__ = ["split_parameters", "reduce_gradients", "clip_grad_norm", "all_reduce_sum",
           "grad_norm_groups"]


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
    for params, axis in ((dense, "dp"), (experts, "edp")):
        grads = [p.grad for p in params if p.grad is not None]
        all_reduce_sum(grads, meshes.group(axis), 1.0 / dims.dp)


def grad_norm_groups(model, sync, dims, tp_split=None):
    """The [(gradients, axes)] groups for `clip_grad_norm` in any layout.

    `sync` tells where each gradient lives (`grad_view`) and over which axes that storage is
    sharded (ZeRO: dense over dp, experts over edp). On top: experts differ over ep; tensor-
    parallel shards differ over tp (`tp_split` = (sharded, replicated, scale_only) dense
    parameters; scale_only are extra replicas of a shard, clipped but not counted); pipeline
    stages hold disjoint parameters (pp)."""
    dense, experts = split_parameters(model)
    sharded, replicated, scale_only = tp_split or ([], dense, [])
    pp = ("pp",) if dims is not None and dims.pp > 1 else ()

    def views(params):
        return [g for g in map(sync.grad_view, params) if g is not None]

    return [(views(replicated), sync.dense_axes + pp),
            (views(sharded), sync.dense_axes + ("tp",) + pp),
            (views(experts), sync.expert_axes + ("ep",) + pp),
            (views(scale_only), None)]


_AXIS_ORDER = ("dp", "edp", "ep", "tp", "pp")


def clip_grad_norm(groups, max_norm: float, meshes, device=None) -> torch.Tensor:
    """Global L2 norm of all gradients, clipped to max_norm in place; returns the norm (float64).

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
    total = torch.stack(squares).sum().sqrt()
    if math.isfinite(max_norm) and grads:
        coef = (max_norm / (total.to(grads[0].dtype) + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
    return total
