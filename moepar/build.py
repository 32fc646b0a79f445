"""The parallel model of a run config: its layout (validated before any collective), the
model built on the meta device and sharded by `parallelize`, and the AdamW factory. Shared by
training, `moepar eval`, `moepar plan`, the dry run and the launcher (which checks a layout
without importing the training loop)."""

import os

import torch

from moepar.config import RunConfig
from moepar.expert_placement import build_expert_maps
from moepar.layers import Transformer
from moepar.parallel import Options, ParallelDims, ParallelOptions, parallelize
from moepar.parallel.adamw import AdamW
from moepar.parallel.hierarchical import node_layout
from moepar.parallel.muon import Muon
from moepar.parallel.schedules import check_schedule

__all__ = ["build_dims", "build_engine", "adamw_factory", "muon_factory", "PARAM_DTYPES", "COMPUTE_DTYPES",
           "STATE_DTYPES"]

# The masters (what the optimizer steps and checkpoints hold) per train.dtype, and the compute
# dtype of bf16/fp16 training (parallel/precision.py: the model's weights between steps).
PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.float32, "float16": torch.float32,
                "float64": torch.float64}
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# The dtype of AdamW's moments per train.optim_state_dtype (None: the masters', torch's own step).
STATE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def adamw_factory(cfg, fused: bool = False):
    """make_adamw(decay, no_decay): AdamW with weight decay on matrices (and expert stacks) only;
    the fused kernel on CUDA while the moments are the masters' dtype (bf16 moments step with
    foreach arithmetic, parallel/adamw.py)."""
    state_dtype = STATE_DTYPES[cfg.optim_state_dtype]

    def make(decay, no_decay):
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        kind = {"fused": True} if fused and state_dtype is None else {"foreach": True}
        return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                     state_dtype=state_dtype, **kind)
    return make


def muon_factory(cfg):
    """make_muon(muon, decay, no_decay, layouts) for train.optimizer="muon", else None: Muon on
    the matrices (weight decay), AdamW on the embedding and head (decay) and 1-D parameters
    (none), one learning rate (parallel/muon.py)."""
    if cfg.optimizer != "muon":
        return None

    def make(muon, decay, no_decay, layouts):
        groups = [{"params": muon, "weight_decay": cfg.weight_decay, "muon": True},
                  {"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return Muon(groups, layouts, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                    momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                    ns_steps=cfg.muon_ns_steps)
    return make


def build_dims(cfg: RunConfig, world_size: int) -> ParallelDims:
    """The layout for this world, validated against the batch sizes; raises before any collective."""
    p = cfg.parallel
    dims = ParallelDims.resolve(world_size, p.pp, p.dp, p.tp, p.ep, cfg.model.num_experts,
                                gpus_per_node=_ranks_per_node(cfg, world_size))
    if p.dispatcher == "hierarchical":     # the nodes the launcher gave, before any collective
        node_layout(dims.ep, dims.gpus_per_node, cfg.model.num_experts, cfg.router.n_group)
    build_expert_maps(cfg, dims.ep)    # a bad placement file or load raises here, on every rank
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dims.dp):
        raise ValueError(f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                         f"train.micro_batch_size={t.micro_batch_size} * dp={dims.dp} (every dp "
                         "rank runs whole micro-batches)")
    if dims.pp > 1:
        local_micro = t.global_batch_size // (t.micro_batch_size * dims.dp)
        try:
            check_schedule(p.pp_schedule, dims.pp, p.pp_virtual, local_micro)
        except ValueError as e:
            raise ValueError(f"parallel.pp_schedule={p.pp_schedule!r}: {e} (micro-batches per "
                             f"step per pipeline = train.global_batch_size / "
                             f"(train.micro_batch_size * dp))") from None
    return dims


def _ranks_per_node(cfg: RunConfig, world_size: int) -> int:
    node = cfg.parallel.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    return node if node < world_size else 0


def build_engine(cfg: RunConfig, layout, device, num_local_micro: int, materialize: bool = True,
                 training: bool = True):
    """The parallel model of `cfg` on `layout` (training, `moepar eval`, the memory simulation):
    the whole model exists only as shapes (meta); `parallelize` shards it and each rank
    allocates and draws its own (`materialize=False`: the shards stay shapes). `training=False`
    (evaluation) keeps no float32 masters under bf16: the compute weights are all there is."""
    t = cfg.train
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.router, seed=t.seed)
    model = model.to(PARAM_DTYPES[t.dtype])
    options = Options(ParallelOptions.of(cfg.parallel), adamw_factory(t, fused=device.type == "cuda"),
                      make_muon=muon_factory(t), qk_clip=t.qk_clip, num_micro=num_local_micro, vocab_size=cfg.model.vocab_size,
                      seq_len=t.seq_len, recompute=t.recompute,
                      compile=t.compile, compile_backend=t.compile_backend,
                      compute_dtype=COMPUTE_DTYPES.get(t.dtype), fp32_residual=t.fp32_residual,
                      seed=t.seed, materialize=materialize, training=training,
                      expert_maps=build_expert_maps(cfg, layout.dims.ep, layout.dims.gpus_per_node),
                      mtp_coeff=t.mtp_coeff)
    return parallelize(model, layout, options)
