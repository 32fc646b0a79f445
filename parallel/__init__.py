"""Everything that knows ranks exist; `parallelize` is the one place that fixes the order.

Order (see shared DESIGN.md): expert and tensor parallelism (change shapes) -> activation
checkpointing -> compile -> pipeline split -> data parallel / ZeRO (wraps parameters last).
This version has expert, tensor (with sequence), pipeline and data parallelism with ZeRO 0-3, in
any combination.
"""

import torch

from .checkpointing import apply_activation_checkpointing
from .dims import ParallelDims
from .ddp import OverlappedReducer
from .expert import apply_ep
from .pipeline import build_stage
from .tensor import apply_tp
from .zero import FullyShardedSync, ShardedAdamW, ZeroReducer

__all__ = ["parallelize", "apply_activation_checkpointing", "apply_ep",
           "ParallelDims", "data_parallel", "LocalSync"]


def parallelize(model, parallel, dims=None, meshes=None, rank: int = 0,
                activation_checkpointing: bool = False, seq_len: int | None = None):
    """Applies the configured parallelisms to `model` in the fixed order; returns the model, or
    under pp > 1 this rank's pipeline stage (a StageModule holding the model's own modules).

    Order: expert and tensor parallelism (change shapes) -> activation checkpointing ->
    pipeline split.
    Data parallelism / ZeRO come last, from `data_parallel`, once the model is on its device.
    """
    if dims is not None and dims.ep > 1:
        apply_ep(model, dims, meshes, rank, parallel.dispatcher, parallel.dedup,
                 parallel.debug_splits)
    if dims is not None and dims.tp > 1:
        apply_tp(model, dims, meshes, seq_len)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if dims is not None and dims.pp > 1:
        model = build_stage(model, dims.coords(rank).pp, dims.pp, parallel.pp_virtual,
                            parallel.pp_layers or None)
    return model


class LocalSync:
    """One process: nothing to reduce; the same interface as the reducers."""

    def before_backward(self, last: bool, step_final: bool | None = None):
        pass

    def after_backward(self, last: bool, step_final: bool | None = None):
        pass

    dense_axes, expert_axes = (), ()

    def grad_view(self, p):
        return p.grad


_WIRE = {"": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def data_parallel(model, parallel, dims, meshes, make_adamw, compute_dtype=None):
    """The last step of parallelize: (gradient sync, optimizer) for parallel.zero.

    `make_adamw(decay_params, no_decay_params)` builds the optimizer over whatever this stage
    steps: the parameters (zero 0 and 3, DTensors under 3) or the flat shards (zero 1 and 2).
    `compute_dtype` (bfloat16 training) is the dtype ZeRO-3 gathers parameters in.
    The sync object has before_backward / after_backward around each backward, and
    grad_view(p) / dense_axes / expert_axes: where a gradient lives after the sync and the axes
    that storage is sharded over (see data.grad_norm_groups). Their arguments: `last`, the last
    backward of the modules it runs in this step; `step_final`, the last backward of the step on
    this rank (they differ only for interleaved pipeline chunks; default: `last`).
    """
    def split(params):
        params = list(params)
        return [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]

    if meshes is None:
        return LocalSync(), make_adamw(*split(model.parameters()))
    wire = _WIRE[parallel.grad_reduce_dtype]
    if parallel.zero == 0:
        sync = OverlappedReducer(model, meshes, dims, parallel.bucket_mb, wire)
        return sync, make_adamw(*split(model.parameters()))
    if parallel.zero in (1, 2):
        sync = ZeroReducer(model, meshes, dims, parallel.zero, parallel.bucket_mb, wire)
        return sync, ShardedAdamW(sync, make_adamw)
    sync = FullyShardedSync(model, meshes, dims, wire, compute_dtype)
    return sync, make_adamw(*split(model.parameters()))
