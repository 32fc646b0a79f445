"""Everything that knows ranks exist; `parallelize` is the one place that fixes the order.

Order (see shared DESIGN.md), applied to a model built on the meta device:
expert and tensor parallelism (change shapes) -> activation recompute -> regional compile
(compile.py, when asked) -> pipeline split ->
ZeRO-3 / FSDP2 (shards parameters) -> materialize this rank's shards on its device and draw their
initial values -> mixed precision (float32 masters, compute weights in bf16; precision.py) ->
data parallel / ZeRO 0-2 (wraps the masters) -> the step runner -> the handle, built once from
those parts. A model that is already materialized (tests, notebooks) goes through the same
order; its values are kept.
"""

from dataclasses import dataclass, fields
from typing import Callable

import torch

from moepar.layers.init import canonical_tensors

from .checkpointing import apply_activation_checkpointing, apply_recompute
from .compile import apply_compile
from .ddp import OverlappedReducer
from .dims import Layout, ParallelDims
from .grads import rows_of
from .expert import apply_ep
from .handle import ParallelModel
from .local_runner import LocalRunner
from .loss import build_loss
from .muon import ShardedMuon, build_layouts
from .pipeline import apply_pp
from .pipeline_runner import PipelineRunner
from .placement import materialize
from .precision import Masters, Precision
from .qkclip import QKClip
from .tensor import apply_tp
from .zero import FullyShardedSync, ShardedAdamW, ZeroReducer

__all__ = ["parallelize", "Options", "ParallelOptions", "ParallelModel", "apply_activation_checkpointing",
           "apply_recompute", "apply_compile", "apply_ep", "ParallelDims", "Layout",
           "data_parallel", "LocalSync"]


@dataclass(frozen=True)
class ParallelOptions:
    """The choices of a run's [parallel] section that `parallelize` reads (moepar/build.py copies
    them from the validated config; parallel/ never imports moepar's config)."""
    zero: int = 0                      # 0 DDP; ZeRO 1, 2, 3 (zero.py)
    dispatcher: str = "alltoall"       # under ep > 1: alltoall, dedup, allgather, hierarchical
    debug_splits: bool = False         # check all-to-all split sizes across ranks
    a2a_chunks: int = 1                # alltoall: expert chunks pipelined between all-to-alls
    bucket_mb: float = 25.0            # gradient buckets reduced while backward runs
    grad_reduce_dtype: str = ""        # "" (the parameters' dtype) or "bfloat16" on the wire
    pp_schedule: str = "1f1b"          # "1f1b", "interleaved_1f1b" or "gpipe"
    pp_virtual: int = 1                # model chunks per pipeline rank
    pp_layers: tuple[int, ...] = ()    # layers per chunk; empty: balanced

    @classmethod
    def of(cls, section) -> "ParallelOptions":
        """These fields of a config section (any object with them, e.g. moepar's ParallelConfig)."""
        values = {f.name: getattr(section, f.name) for f in fields(cls)}
        return cls(**dict(values, pp_layers=tuple(values["pp_layers"])))


@dataclass
class Options:
    """What `parallelize` needs beyond the layout; the trainer fills it from the run config."""
    parallel: ParallelOptions          # the [parallel] choices (zero, dispatcher, pp_schedule, ...)
    make_optimizer: Callable           # (decay parameters, no-decay parameters) -> optimizer
    make_muon: Callable | None = None  # train.optimizer="muon": (muon, decay, no-decay, layouts)
    qk_clip: float = 0.0               # MuonClip's tau (qkclip.py); 0: off
    num_micro: int = 1                 # micro-batches per step on each data-parallel rank
    vocab_size: int = 0
    seq_len: int | None = None
    recompute: str = "none"            # none, full, attention, experts (checkpointing.py)
    compile: bool = False              # torch.compile each block's maths (compile.py)
    compile_backend: str = "inductor"
    compute_dtype: torch.dtype | None = None   # bfloat16/float16 training; None: the parameters'
    fp32_residual: bool = False        # keep the residual stream float32 under compute_dtype
    seed: int = 0                      # initial values (layers/init.py), the same at any layout
    materialize: bool = True           # False: stay on meta (memory simulation)
    training: bool = True              # keep float32 masters for an optimizer (bf16 training)
    expert_maps: dict | None = None    # MoE layer number -> ExpertMap (expert_map.py); contiguous
    mtp_coeff: float = 0.0             # weight of the mean MTP loss (model.mtp_layers)


def parallelize(model, layout: Layout, options: Options) -> ParallelModel:
    """Applies every parallelism to `model` (a whole `Transformer`, on meta or materialized) in
    the fixed order; returns the handle the trainer talks to (see handle.py)."""
    dims, p = layout.dims, options.parallel
    canonical = canonical_tensors(model)              # the whole model's names and shapes
    moe_layer_ids = [block.layer_id for block in model.blocks() if block.is_moe]
    param_dtype = next(model.parameters()).dtype
    if dims.ep > 1:
        apply_ep(model, dims, layout.meshes, layout.rank, p.dispatcher, p.debug_splits,
                 p.a2a_chunks, options.expert_maps)
    if dims.tp > 1:
        apply_tp(model, dims, layout.meshes, options.seq_len)
    if options.recompute != "none":
        apply_recompute(model, options.recompute)
    compiled = apply_compile(model, options.compile_backend) if options.compile else None
    if dims.pp > 1:
        model = apply_pp(model, layout.coords.pp, dims.pp, p.pp_virtual, p.pp_layers or None)
        if compiled is not None:
            compiled = compiled.held_by(model)
    on_meta = next(model.parameters()).device.type == "meta"
    if not on_meta:
        model.to(layout.device)
    fsdp = None
    if layout.meshes is not None and p.zero == 3:
        fsdp = FullyShardedSync(model, layout.meshes, dims, _WIRE[p.grad_reduce_dtype],
                                options.compute_dtype, options.fp32_residual)
    if on_meta and options.materialize:
        materialize(model, layout, canonical, options.seed)
    # ZeRO-3's FSDP2 keeps the float32 shards as masters and gathers them in the compute dtype.
    masters = Masters(model, None if fsdp is not None else options.compute_dtype,
                      training=options.training)
    precision = Precision(layout.device.type, options.compute_dtype, param_dtype,
                          options.fp32_residual)
    precision.widen_embeddings(model)
    sync, optimizer = data_parallel(model, layout, p, options.make_optimizer, fsdp, masters,
                                    options.make_muon)
    runner = None
    if not (on_meta and not options.materialize):    # shapes only (memory simulation): no runner
        loss_fn = build_loss(layout.group("tp") if dims.tp > 1 else None, options.vocab_size)
        if dims.pp > 1:
            # Under bfloat16 training hidden states cross stages in bfloat16 (half the bytes).
            runner = PipelineRunner(model, options.num_micro, loss_fn, pp_group=layout.group("pp"),
                                    schedule=p.pp_schedule, autocast=precision.autocast,
                                    act_dtype=precision.residual_dtype,
                                    wire_dtype=options.compute_dtype,
                                    balance_group=layout.group("dp"),
                                    mtp_coeff=options.mtp_coeff)
        else:
            runner = LocalRunner(model, options.num_micro, loss_fn, autocast=precision.autocast,
                                 balance_group=layout.group("dp"), mtp_coeff=options.mtp_coeff)
    qk_clip = None
    if options.qk_clip > 0 and runner is not None:
        qk_clip = QKClip(model, options.qk_clip, masters, layout.group("dp"), layout.device)
    return ParallelModel(model, layout, canonical, moe_layer_ids, p.zero, options.num_micro,
                         sync, optimizer, runner, masters, precision, compiled, qk_clip)


class LocalSync:
    """One process: nothing to reduce; the same interface as the reducers. Under bf16 training
    the masters' hooks add each gradient into its float32 master."""

    def __init__(self, masters: Masters):
        self.masters = masters
        self.hooks = masters.grad_hooks()

    def before_backward(self, last: bool, step_final: bool | None = None):
        pass

    def after_backward(self, last: bool, step_final: bool | None = None):
        pass

    dense_axes, expert_axes = (), ()

    def grad_view(self, p, rows=None):
        return rows_of(self.masters.master(p).grad, rows)


_WIRE = {"": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def data_parallel(model, layout: Layout, parallel: ParallelOptions, make_adamw, fsdp=None,
                  masters=None, make_muon=None):
    """The last wrapping: (gradient sync, optimizer) for parallel.zero.

    `make_adamw(decay_params, no_decay_params)` builds the optimizer over whatever this stage
    steps: the masters (zero 0; the parameters themselves without bf16 training; DTensors under
    3) or their flat shards (zero 1 and 2). `fsdp` is the FullyShardedSync of zero 3 (applied
    earlier, on the meta model); `masters` precision.py's.
    The sync object has before_backward / after_backward around each backward, and
    grad_view(p) / dense_axes / expert_axes: where a gradient lives after the sync and the axes
    that storage is sharded over (see grads.grad_norm_groups). Their arguments: `last`, the last
    backward of the modules it runs in this step; `step_final`, the last backward of the step on
    this rank (they differ only for interleaved pipeline chunks; default: `last`).
    `make_muon(muon, decay, no_decay, layouts)` replaces make_adamw under train.optimizer="muon"
    (muon.py: which parameters it steps, and how each matrix is gathered whole).
    """
    masters = masters or Masters(model)
    meshes, dims = layout.meshes, layout.dims
    layouts = {} if make_muon is None else build_layouts(
        model, masters, layout.group("tp") if dims.tp > 1 else None)

    def build(params):
        params = list(params)
        matrices = [p for p in params if p.dim() >= 2 and id(p) not in layouts]
        vectors = [p for p in params if p.dim() < 2]
        if make_muon is None:
            return make_adamw(matrices, vectors)
        return make_muon([p for p in params if id(p) in layouts], matrices, vectors, layouts)

    if meshes is None:
        return LocalSync(masters), build(masters.masters(model.parameters()))
    wire = _WIRE[parallel.grad_reduce_dtype]
    if parallel.zero == 0:
        sync = OverlappedReducer(model, meshes, dims, parallel.bucket_mb, wire, masters=masters)
        return sync, build(masters.masters(model.parameters()))
    if parallel.zero in (1, 2):
        split = True if make_muon is None else (
            lambda q: "muon" if id(masters.master(q)) in layouts else q.dim() >= 2)
        sync = ZeroReducer(model, meshes, dims, parallel.zero, parallel.bucket_mb, wire,
                           masters=masters, split=split)
        if make_muon is None:
            return sync, ShardedAdamW(sync, make_adamw)
        return sync, ShardedMuon(sync, layouts, lambda *groups: make_muon(*groups, {}))
    return fsdp, build(model.parameters())
