"""Closed-form bytes per rank of parameters, gradients and optimizer state, for any model config
and layout: the numbers `moepar bench memory --simulate` measures on the meta device, and the
planner's ground truth.

Legend: D model dim, E experts, L layers; N = dp (dense) or edp (experts) for ZeRO. The tensors
of a model and their shapes per tp rank are layers/shapes.py's (tensor_shapes, with its table).

Per rank: the layers of its pipeline chunks (embedding with chunk 0, norm and head with the
last). Bytes: parameters P = 4 (8 for float64; bfloat16 training keeps float32 masters, and
beside them, under ZeRO 0-2, a bf16 copy of every weight but the routers': the compute weights,
parallel/precision.py), gradients the same, AdamW state 2P (4 bytes under
train.optim_state_dtype = "bfloat16", whatever P). ZeRO shards over N ranks: 1 the optimizer state, 2 also
gradients, 3 also parameters. Stages 1 and 2 pad each flat bucket to a multiple of N (at most
N-1 elements per bucket, ignored here); stage 3 (FSDP2) chunks each tensor along its first
dimension that N divides (else dim 0), in torch.chunk sizes, computed here exactly.
"""

import functools
import math

from moepar.layers.shapes import tensor_shapes
from moepar.parallel.pipeline import rank_chunks, split_layers
from moepar.parallel.shards import fsdp_range

__all__ = ["rank_memory", "bucket_sizes", "moment_bytes"]


def moment_bytes(train_cfg) -> int | None:
    """Bytes per AdamW moment element under train.optim_state_dtype (None: the masters')."""
    return 2 if train_cfg.optim_state_dtype == "bfloat16" else None


@functools.lru_cache(maxsize=4096)    # the planner asks for the same shapes many times
def _fsdp_local(shape: tuple, world: int, index: int) -> int:
    """Elements of FSDP2's chunk of a tensor on rank `index` of `world` (zero 3)."""
    dim = next((d for d in range(len(shape)) if shape[d] % world == 0), 0)
    start, stop = fsdp_range(shape[dim], world, index)
    return math.prod(shape) // shape[dim] * (stop - start) if shape[dim] else 0


def _rank_groups(cfg, dims, rank: int, pp_virtual: int, pp_layers, shapes) -> list:
    """This rank's tensor groups (embedding, its layers, final norm and head), in registration
    order."""
    coords = dims.coords(rank)
    counts = split_layers(cfg.num_layers, dims.pp, pp_virtual, pp_layers or None)
    chunks = rank_chunks(coords.pp, dims.pp, pp_virtual)
    layers = sorted(i for c in chunks for i in range(sum(counts[:c]), sum(counts[:c + 1])))
    return ([shapes["first"]] if 0 in chunks else []) + [shapes[i] for i in layers] + \
        ([shapes["last"]] if dims.pp * pp_virtual - 1 in chunks else [])


def bucket_sizes(cfg, dims, rank: int, bucket_bytes: float, element_bytes: int = 4,
                 pp_virtual: int = 1, pp_layers: list[int] | None = None) -> list[int]:
    """Elements of each gradient bucket on `rank` in launch order, as parallel/ddp.py forms
    them: tensors in reverse registration order, a new bucket when the group (dense: dp,
    experts: edp) or the weight decay (matrices only) changes, or the next tensor would pass
    `bucket_bytes`. (Alignment padding ignored.)"""
    shapes = tensor_shapes(cfg, tp=dims.tp)
    tensors = [(shape, kind) for group in _rank_groups(cfg, dims, rank, pp_virtual, pp_layers,
                                                       shapes) for shape, kind in group]
    sizes, key, size = [], None, 0
    for shape, kind in reversed(tensors):
        if kind == "expert":
            shape = (shape[0] // dims.ep,) + shape[1:]
        n, this = math.prod(shape), (kind == "expert", len(shape) >= 2)
        if size and (this != key or (size + n) * element_bytes > bucket_bytes):
            sizes.append(size)
            size = 0
        key, size = this, size + n
    return sizes + ([size] if size else [])


def rank_memory(cfg, dims, rank: int, zero: int = 0, element_bytes: int = 4,
                pp_virtual: int = 1, pp_layers: list[int] | None = None,
                shapes: dict | None = None, compute_bytes: int = 0,
                moment_bytes: int | None = None) -> dict:
    """Bytes of parameters (masters), gradients and AdamW state on `rank`, and its element
    counts; `compute_weights`: the bf16 copies `compute_bytes` each (ZeRO 0-2; ZeRO-3's FSDP2
    gathers them per block instead); `moment_bytes` per AdamW moment element (default
    element_bytes; 2 under train.optim_state_dtype = "bfloat16"). `shapes`:
    tensor_shapes(cfg, tp=dims.tp), when the caller has it."""
    coords = dims.coords(rank)
    shapes = shapes or tensor_shapes(cfg, tp=dims.tp)
    groups = _rank_groups(cfg, dims, rank, pp_virtual, pp_layers, shapes)
    dense = expert = routers = 0
    dense_shard = expert_shard = 0.0
    for group in groups:
        for shape, kind in group:
            if kind == "router":
                routers += math.prod(shape)
            if kind == "expert":
                shape = (shape[0] // dims.ep,) + shape[1:]
                n, world, index = math.prod(shape), dims.edp, coords.edp
                expert += n
                expert_shard += _fsdp_local(shape, world, index) if zero == 3 else n / world
            else:
                # dense state is sharded over dp x cp (dp_cp), rank order dp-major
                n, world, index = math.prod(shape), dims.dp * dims.cp, coords.dp * dims.cp + coords.cp
                dense += n
                dense_shard += _fsdp_local(shape, world, index) if zero == 3 else n / world
    full, shard = dense + expert, dense_shard + expert_shard
    compute = compute_bytes * (full - routers) if zero < 3 else 0
    return {"dense_params": dense, "expert_params": expert, "compute_weights": compute,
            "params": element_bytes * (shard if zero == 3 else full),
            "grads": element_bytes * (shard if zero >= 2 else full),
            "optimizer": 2 * (moment_bytes or element_bytes) * (shard if zero >= 1 else full)}
