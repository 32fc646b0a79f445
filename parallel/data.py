"""Data parallelism (plain): reduce gradients at step end, and the global gradient norm.

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

from moepar.layers.experts import GroupedExperts

__all__ = ["split_parameters", "reduce_gradients", "clip_grad_norm", "all_reduce_sum"]


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


def clip_grad_norm(model, max_norm: float, meshes) -> torch.Tensor:
    """Global L2 norm of all gradients (each expert counted once), clipped to max_norm in place.

    Dense gradients are identical on every rank after `reduce_gradients`; expert gradients are
    identical across edp, so their squares are summed over ep only.
    """
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm
    dense, experts = split_parameters(model)
    params = [p for p in dense + experts if p.grad is not None]
    squares = torch.zeros(2, dtype=torch.float64, device=params[0].device)
    for i, group in enumerate((dense, experts)):
        grads = [p.grad for p in group if p.grad is not None]
        if grads:
            squares[i] = get_total_norm(grads).double().square()
    if meshes is not None:
        expert_sq = squares[1:]
        all_reduce_sum([expert_sq], meshes.group("ep"))
        squares[1:] = expert_sq
    total = squares.sum().sqrt()
    if math.isfinite(max_norm):
        clip_grads_with_norm_(params, max_norm, total.to(params[0].dtype))
    return total
