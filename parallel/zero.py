"""ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) sharded; dense state over `dp`,
expert state over `edp`.

Talks on `dp` and `edp` (reduce-scatter of gradients, all-gather of parameters).

| stage | what each rank keeps between steps                   | machinery                          |
|-------|------------------------------------------------------|------------------------------------|
| 1     | full parameters and gradients, 1/N of AdamW state    | `ZeroReducer` + `ShardedAdamW` here |
| 2     | full parameters, 1/N of gradients and AdamW state    | `ZeroReducer` + `ShardedAdamW` here |
| 3     | 1/N of parameters, gradients and AdamW state         | torch FSDP2 `fully_shard`          |

Stages 1 and 2 are a small piece of our own on the DDP buckets (ddp.py): each bucket's parameters
become views into one flat buffer, padded to a multiple of the group size N, and rank i owns the
i-th contiguous 1/N of it. AdamW steps a `Parameter` that is a view of that slice, so updating the
shard updates the model's parameters in place; one all-gather per bucket then refreshes the rest.
Buckets never mix decayed and undecayed parameters, so every shard has one weight decay.
- stage 1: gradients accumulate in a persistent flat buffer; on the last micro-batch each bucket
  is reduce-scattered while backward runs and the rank's slice becomes the shard's gradient.
- stage 2: every micro-batch reduce-scatters each bucket as soon as it is final and frees the
  full gradients, adding the result into the shard's gradient (the ZeRO-2 trade: one
  reduce-scatter per micro-batch for 1/N gradient memory). At most `IN_FLIGHT` buckets' flat
  copies wait on the wire: launching one more settles the oldest, so full-size gradients never
  pile up (holding every bucket until the end of backward would make the peak ZeRO-1's).
torch's ZeroRedundancyOptimizer gives each rank whole parameters (uneven shards, no gradient
sharding) and FSDP2 has no "parameters replicated, gradients sharded" mode, hence this piece.

Stage 3 is FSDP2: each `GroupedExperts` is sharded over `edp`, each block and the root over `dp`;
FSDP averages over its mesh, so expert gradients get an all-reduce hook that rescales the mean
over edp into (sum over edp) / dp, the same normalisation as dense parameters (see expert.py).
Sum-only reductions are forced because gloo has no PREMUL_SUM.
"""

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .ddp import OverlappedReducer, align
from .shards import fsdp_range

__all__ = ["ZeroReducer", "ShardedAdamW", "FullyShardedSync"]


class ZeroReducer(OverlappedReducer):
    IN_FLIGHT = 2      # stage 2: reduce-scatters in flight before the oldest is waited and freed

    def __init__(self, model, meshes, dims, stage: int, bucket_mb: float = 25.0, reduce_dtype=None,
                 masters=None, split=True):
        # split: True (decayed / not), or model parameter -> bucket kind (muon.py's optimizers)
        super().__init__(model, meshes, dims, bucket_mb, reduce_dtype, split_decay=split,
                         grad_views=False, masters=masters)
        if stage not in (1, 2):
            raise ValueError(f"ZeroReducer is for parallel.zero=1 or 2, not {stage}")
        self.stage, self.reduce_every_micro = stage, stage == 2
        self._in_flight = []
        with torch.no_grad():
            for bucket in self.buckets:
                self._flatten(bucket)

    def _flatten(self, b):
        n = dist.get_world_size(b.group)
        b.size, b.index = n, dist.get_rank(b.group)
        # Shards are 16-element aligned too; the flat buffer is n of them (zeros past the end).
        b.shard_len = align(math.ceil(b.numel / n))
        first = b.params[0]
        b.flat = torch.zeros(b.shard_len * n, dtype=first.dtype, device=first.device)
        for p in b.params:
            start = b.offsets[id(p)]
            view = b.flat[start:start + p.numel()]
            view.copy_(p.reshape(-1))
            p.data = view.view_as(p)
        mine = slice(b.index * b.shard_len, (b.index + 1) * b.shard_len)
        b.mine = mine
        b.shard = nn.Parameter(b.flat[mine])          # shares storage with the parameters
        self.grad_views = self.stage == 1     # stage 1 accumulates in place (lazily allocated)

    def _flat_length(self, b) -> int:
        return b.flat.numel()

    def _flat_grads(self, b):
        """Stage 2: this micro-batch's gradients laid out like the flat buffer (zeros between)."""
        flat = torch.zeros_like(b.flat)
        for p in b.params:
            if p.grad is not None:
                start = b.offsets[id(p)]
                flat[start:start + p.numel()].copy_(p.grad.reshape(-1))
        return flat

    def zero_grad(self):
        for b in self.buckets:
            b.shard.grad = None
            if b.flat_grad is not None:
                b.flat_grad.zero_()
                self._attach_grads(b)     # in case anything replaced a view
            else:
                for p in b.params:
                    p.grad = None

    dense_axes, expert_axes = ("dp",), ("edp",)

    def grad_view(self, p, rows=None):
        """The part of model parameter p's gradient (of rows [start, stop) of dim 0 when `rows`)
        in this rank's shard (possibly empty), or None."""
        p = self.masters.master(p)
        b = self.bucket_of[id(p)]
        if b.shard.grad is None:
            return None
        start, end = b.offsets[id(p)], b.offsets[id(p)] + p.numel()
        if rows is not None:     # rows are contiguous in the flat buffer
            row = p.numel() // p.shape[0]
            start, end = start + rows[0] * row, start + rows[1] * row
        lo, hi = b.mine.start, b.mine.stop
        first, last = max(start, lo), min(end, hi)
        return b.shard.grad[first - lo:max(first, last) - lo]

    def _launch(self, b):
        if b.flat_grad is not None:
            flat = b.flat_grad
        else:
            flat = self._flat_grads(b)
            for p in b.params:
                p.grad = None                          # stage 2: only the shard survives
        b.wire = self._to_wire(flat)
        b.out = torch.empty(b.shard_len, dtype=b.wire.dtype, device=b.wire.device)
        b.handle = comm.reduce_scatter_single(b.out, b.wire, group=b.group, async_op=True)
        if b.flat_grad is None:        # stage 2: bound the full-size copies in flight
            self._in_flight.append(b)
            while len(self._in_flight) > self.IN_FLIGHT:
                self._settle(self._in_flight.pop(0))

    def arm(self):
        super().arm()
        self._in_flight = []

    def _complete(self, b):
        reduced = b.out.to(b.flat.dtype).mul_(self.scale)
        if b.flat_grad is not None:
            target = b.flat_grad[b.mine]
            target.copy_(reduced)
            b.shard.grad = target
        elif b.shard.grad is None:
            b.shard.grad = reduced
        else:
            b.shard.grad.add_(reduced)
        b.out = None


class ShardedAdamW:
    """AdamW over the ZeroReducer's shards; after each step, one all-gather per bucket.

    Looks like a torch optimizer to the trainer (param_groups, step, zero_grad); checkpoints see
    each bucket's shard of the AdamW state as boxes of the parameters (handle.optimizer_shards).
    """

    def __init__(self, reducer: ZeroReducer, make_adamw):
        self.reducer = reducer
        buckets = reducer.buckets
        self.inner = make_adamw([b.shard for b in buckets if b.decay],
                                [b.shard for b in buckets if not b.decay])
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    @torch.no_grad()
    def step(self):
        self.inner.step()
        handles = []
        for b in self.reducer.buckets:
            if b.size > 1:   # in place: this rank's input is its own slice of the output
                handles.append(comm.all_gather_single(b.flat, b.shard.detach(), group=b.group,
                                                      async_op=True))
        for handle in handles:
            handle.wait()

    def zero_grad(self, set_to_none: bool = True):
        self.reducer.zero_grad()


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


class FullyShardedSync:
    """zero=3: FSDP2 over two meshes; the training step's side of it."""

    def __init__(self, model, meshes, dims, reduce_dtype=None, compute_dtype=None,
                 fp32_residual: bool = False):
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import Shard
        if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
            raise ValueError(f"parallel.zero=3 needs torch >= 2.8 (FSDP2's sum-only reductions); "
                             f"this is torch {torch.__version__}. Use parallel.zero=2 or upgrade")
        if compute_dtype is not None and _torch_version() < (2, 12):
            # Measured: backward fails inside FSDP2 ("setStorage ... storage of size 0") on
            # torch 2.9 and 2.11 when parameters are gathered in a lower precision.
            raise ValueError(f"parallel.zero=3 with train.dtype=bfloat16 needs torch >= 2.12 "
                             f"(FSDP2 mixed precision fails in backward before); this is torch "
                             f"{torch.__version__}. Use parallel.zero=2 or upgrade")
        self.model = model
        # Under bf16 the weights are gathered in bf16 (half the bytes: these are the compute
        # weights, precision.py); gradients are reduced in float32 unless a wire dtype is set.
        # Inputs keep their dtype; routers stay float32 (routing maths is), and so does the root
        # (embedding, final norm, head) under train.fp32_residual (the embedding then starts a
        # float32 residual stream).
        reduce_dtype = reduce_dtype or (torch.float32 if compute_dtype is not None else None)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                      cast_forward_inputs=False)
        fp32_policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype, cast_forward_inputs=False)
        dp_mesh, edp_mesh = meshes.dense["dp"], meshes.expert["edp"]

        def placement(mesh):
            # Shard the first dimension the group divides (experts: [E_local, D, U] with
            # E_local < edp would otherwise be padded), else dimension 0.
            size = mesh.size()
            return lambda p: Shard(next((d for d in range(p.dim()) if p.shape[d] % size == 0), 0))

        expert_scale = dims.edp / dims.dp
        for block in model.blocks():     # the MTP depths' blocks too (layers/mtp.py)
            if block.is_moe:
                experts = block.ffn.experts
                fully_shard(experts, mesh=edp_mesh, mp_policy=policy,
                            shard_placement_fn=placement(edp_mesh))
                if expert_scale != 1.0:
                    experts.set_all_reduce_hook(lambda g, s=expert_scale: g.mul_(s))
                if compute_dtype is not None:
                    fully_shard(block.ffn.router, mesh=dp_mesh, mp_policy=fp32_policy)
            fully_shard(block, mesh=dp_mesh, mp_policy=policy, shard_placement_fn=placement(dp_mesh))
        fully_shard(model, mesh=dp_mesh, mp_policy=fp32_policy if fp32_residual else policy,
                    shard_placement_fn=placement(dp_mesh))
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        # A block's outputs include MoEOutput.y, a view that Block already consumed out of place
        # (h + y); FSDP's warning about in-place ops on returned views does not apply.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(Block|Transformer|"
                                r"TensorParallelTransformer)\) returned a view tensor")

    def before_backward(self, last: bool, step_final: bool | None = None):
        # Per module: under interleaved pipelining each chunk's blocks sync on their own last
        # backward (a chunk's backward only runs its own blocks).
        self.model.set_requires_gradient_sync(last)

    def after_backward(self, last: bool, step_final: bool | None = None):
        pass

    dense_axes, expert_axes = ("dp",), ("edp",)

    def grad_view(self, p, rows=None):
        if p.grad is None:
            return None
        local = p.grad.to_local()
        (placement,) = p.placements
        if rows is None or placement.dim != 0:    # every row here (or a slice of each row)
            return local if rows is None else local[rows[0]:rows[1]]
        # This rank's FSDP2 chunk holds rows [c0, c1) of dim 0 (torch.chunk sizes).
        c0, c1 = fsdp_range(p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank())
        a, b = max(rows[0], c0), min(rows[1], c1)
        return local[a - c0:max(a, b) - c0]
