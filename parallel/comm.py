"""Differentiable collectives: each is an autograd Function whose backward is the adjoint.

Talks on whatever group it is given (the expert-parallel `ep` group, in practice).

| function            | forward                                  | backward                                 | host sync |
|---------------------|------------------------------------------|------------------------------------------|-----------|
| all_to_all          | all_to_all_single, uneven splits         | all_to_all_single, splits swapped        | none      |
| all_gather_rows     | all_gather_into_tensor (equal rows)      | reduce_scatter_tensor (sum)              | none      |
| reduce_scatter_rows | reduce_scatter_tensor (sum, equal rows)  | all_gather_into_tensor                   | none      |

Split sizes are host lists supplied by the caller (the dispatcher's one sync per layer). Every
function short-circuits on a group of one rank, so callers never branch on the degree.
"""

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "all_gather_rows", "reduce_scatter_rows", "group_size", "to_wire",
           "all_gather_single", "reduce_scatter_single"]


def to_wire(x):
    """Hidden states in the autocast dtype before they travel (the experts would cast them on
    arrival anyway): under bf16 autocast the residual stream is fp32, and sending it as is would
    double the bytes. Outside autocast, a no-op."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def group_size(group) -> int:
    return dist.get_world_size(group)


def _a2a(x, out_splits: list[int], in_splits: list[int], group):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x, out_splits: list[int], in_splits: list[int], group):
    """Rows x[sum(in_splits[:j]) : ...+in_splits[j]] go to rank j; returns rows received, by source."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, group)


# torch 2.13 renamed these (the old names warn); older torch has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x, group):
    out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x, group):
    out = x.new_empty((x.shape[0] // group_size(group),) + tuple(x.shape[1:]))
    reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


class _RowsCollective(torch.autograd.Function):
    """forward: `op(x, group)`; backward: its adjoint `adjoint(grad, group)` (gather <-> reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, op, adjoint):
        ctx.group, ctx.adjoint = group, adjoint
        return op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad, ctx.group), None, None, None


def all_gather_rows(x, group):
    """Concatenates every rank's x (same shape on all ranks) along dim 0, in rank order."""
    if group_size(group) == 1:
        return x
    return _RowsCollective.apply(x, group, _gather, _reduce_scatter)


def reduce_scatter_rows(x, group):
    """Sums x over ranks and returns this rank's block of rows (dim 0 divisible by the size)."""
    if group_size(group) == 1:
        return x
    return _RowsCollective.apply(x, group, _reduce_scatter, _gather)
