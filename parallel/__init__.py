"""Everything that knows ranks exist; `parallelize` is the one place that fixes the order.

Order (see shared DESIGN.md), applied to a model built on the meta device:
expert and tensor parallelism (change shapes) -> activation recompute -> pipeline split ->
ZeRO-3 / FSDP2 (shards parameters) -> materialize this rank's shards on its device and draw their
initial values -> data parallel / ZeRO 0-2 (wraps the materialized parameters) -> the step runner.
A model that is already materialized (tests, notebooks) goes through the same order; its values
are kept.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from moepar.layers.experts import GroupedExperts

from .checkpointing import apply_activation_checkpointing, apply_recompute
from .ddp import OverlappedReducer
from .dims import Layout, ParallelDims
from .expert import apply_ep
from .handle import LocalRunner, ParallelModel, materialize
from .pipeline import apply_pp
from .pipeline_runner import PipelineRunner
from .schedules import peak_in_flight
from .tensor import apply_tp
from .zero import FullyShardedSync, ShardedAdamW, ZeroReducer

__all__ = ["parallelize", "Options", "ParallelModel", "apply_activation_checkpointing",
           "apply_recompute",
           "apply_ep", "ParallelDims", "Layout", "data_parallel", "LocalSync"]


@dataclass
class Options:
    """What `parallelize` needs beyond the layout; the trainer fills it from the run config."""
    parallel: object                   # the [parallel] section (zero, dispatcher, pp_schedule, ...)
    make_optimizer: Callable           # (decay parameters, no-decay parameters) -> optimizer
    num_micro: int = 1                 # micro-batches per step on each data-parallel rank
    vocab_size: int = 0
    seq_len: int | None = None
    recompute: str = "none"            # none, full, attention, experts (checkpointing.py)
    compute_dtype: torch.dtype | None = None   # autocast dtype (bfloat16), None: the parameters'
    seed: int = 0                      # initial values (layers/init.py), the same at any layout
    materialize: bool = True           # False: stay on meta (memory simulation)


def parallelize(model, layout: Layout, options: Options) -> ParallelModel:
    """Applies every parallelism to `model` (a whole `Transformer`, on meta or materialized) in
    the fixed order; returns the handle the trainer talks to (see handle.py)."""
    from moepar.layers.init import canonical_tensors
    dims, p = layout.dims, options.parallel
    canonical = canonical_tensors(model)              # the whole model's names and shapes
    moe_layer_ids = [block.layer_id for block in model.layers if block.is_moe]
    if dims.ep > 1:
        apply_ep(model, dims, layout.meshes, layout.rank, p.dispatcher, p.debug_splits,
                 p.a2a_chunks)
    if dims.tp > 1:
        apply_tp(model, dims, layout.meshes, options.seq_len)
    if options.recompute != "none":
        apply_recompute(model, options.recompute)
    if dims.pp > 1:
        model = apply_pp(model, layout.coords.pp, dims.pp, p.pp_virtual, p.pp_layers or None)
    on_meta = next(model.parameters()).device.type == "meta"
    if not on_meta:
        model.to(layout.device)
    fsdp = None
    if layout.meshes is not None and p.zero == 3:
        fsdp = FullyShardedSync(model, layout.meshes, dims, _WIRE[p.grad_reduce_dtype],
                                options.compute_dtype)
    handle = ParallelModel(model, layout, canonical, moe_layer_ids, p.zero, options.compute_dtype,
                           options.num_micro, options.vocab_size)
    if on_meta and options.materialize:
        materialize(model, layout, canonical, options.seed)
    sync, optimizer = data_parallel(model, layout, p, options.make_optimizer, fsdp)
    if on_meta and not options.materialize:   # shapes only (memory simulation): nothing to run
        handle.attach(sync, optimizer, None)
        return handle
    if dims.pp > 1:
        # Under bfloat16 training hidden states cross stages in bfloat16 (half the bytes).
        wire = torch.bfloat16 if options.compute_dtype == torch.bfloat16 else None
        runner = PipelineRunner(model, layout.group("pp"), p.pp_schedule, options.num_micro,
                                loss_fn=handle.loss_fn, autocast=handle.autocast, wire_dtype=wire,
                                balance_group=layout.group("dp"))
    else:
        runner = LocalRunner(model, options.num_micro, handle.loss_fn, handle.autocast,
                             balance_group=layout.group("dp"))
    if options.compute_dtype is not None and p.zero < 3 and options.recompute == "none" \
            and peak_in_flight(runner.order) > 1:
        # Several micro-batches in flight here, each keeping its own cast of the weights: one
        # shared cast per step instead (ParallelModel.step_scope). With one in flight, each
        # micro-batch's copies go as its backward passes them, so that stays; recompute drops a
        # region's casts after its forward (a step-long cast would hold them), and ZeRO-3's
        # FSDP2 gathers the weights in bf16 and frees them after use.
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                m.casts = handle.casts
        runner.step_scope, runner.backward_scope = handle.step_scope, handle.backward_scope
    handle.attach(sync, optimizer, runner)
    return handle


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


def data_parallel(model, layout: Layout, parallel, make_adamw, fsdp=None):
    """The last wrapping: (gradient sync, optimizer) for parallel.zero.

    `make_adamw(decay_params, no_decay_params)` builds the optimizer over whatever this stage
    steps: the parameters (zero 0 and 3, DTensors under 3) or the flat shards (zero 1 and 2).
    `fsdp` is the FullyShardedSync of zero 3 (applied earlier, on the meta model).
    The sync object has before_backward / after_backward around each backward, and
    grad_view(p) / dense_axes / expert_axes: where a gradient lives after the sync and the axes
    that storage is sharded over (see data.grad_norm_groups). Their arguments: `last`, the last
    backward of the modules it runs in this step; `step_final`, the last backward of the step on
    this rank (they differ only for interleaved pipeline chunks; default: `last`).
    """
    def split(params):
        params = list(params)
        return [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]

    meshes, dims = layout.meshes, layout.dims
    if meshes is None:
        return LocalSync(), make_adamw(*split(model.parameters()))
    wire = _WIRE[parallel.grad_reduce_dtype]
    if parallel.zero == 0:
        sync = OverlappedReducer(model, meshes, dims, parallel.bucket_mb, wire)
        return sync, make_adamw(*split(model.parameters()))
    if parallel.zero in (1, 2):
        sync = ZeroReducer(model, meshes, dims, parallel.zero, parallel.bucket_mb, wire)
        return sync, ShardedAdamW(sync, make_adamw)
    return fsdp, make_adamw(*split(model.parameters()))
