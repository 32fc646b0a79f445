"""Run configuration: nested dataclasses loaded from TOML, overridden by `--section.key=value`.

Every section validates itself in `__post_init__`; `RunConfig` adds the checks that span sections.
All of it runs before any model, process group or file is created, so a bad config costs nothing.
The model and router sections are the dataclasses `moepar.layers` builds from.
"""

import dataclasses
import inspect
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from importlib.resources import files

from moepar.jsonfile import read_toml
from moepar.layers.model import ModelConfig
from moepar.layers.router import RouterConfig, check_number
from moepar.parallel.checkpointing import RECOMPUTE
from moepar.parallel.compile import COMPILE_BACKENDS
from moepar.parallel.context import check_cp
from moepar.parallel.expert import DISPATCHERS
from moepar.parallel.hierarchical import node_layout
from moepar.parallel.pipeline import split_layers
from moepar.parallel.schedules import SCHEDULES
from moepar.parallel.tensor import check_tp

__all__ = ["RunConfig", "ParallelConfig", "TrainConfig", "DataConfig", "RunDirConfig",
           "load_config", "config_path", "packaged_examples", "parse_overrides", "to_toml",
           "to_dict", "sections_toml", "config_reference", "model_sections"]

DTYPES = ("float32", "bfloat16", "float16", "float64")
OPTIM_STATE_DTYPES = ("float32", "bfloat16")
# Keys an older moepar read, and what says the same now (a config that sets one is refused with this).
RENAMED = {"parallel.dedup": 'set parallel.dispatcher = "dedup" (the dispatcher kinds are one key)'}
DATA_SOURCES = ("builtin", "text", "tokens")
DATA_PACKS = ("none", "documents")
TOKEN_DTYPES = ("uint8", "uint16", "int32", "int64")
MAX_COUNT = 1 << 53       # steps and positions: a checkpoint stores them as JSON numbers


def check_at_most(section: str, obj, limits: dict):
    """Upper bounds that keep a run possible ({field: largest allowed}); ValueError naming the
    field. (Lower bounds are each section's own checks.)"""
    for name, most in limits.items():
        value = getattr(obj, name)
        if value > most:
            raise ValueError(f"{section}.{name}={value} exceeds {most:,}, more than any run can "
                             "use")


@dataclass
class ParallelConfig:
    """Degrees of each parallelism; pp * dp * cp * tp is the world size, experts fold over
    dp * cp * tp."""
    dp: int = 0                  # 0: the rest of the world, world_size / (pp * cp * tp)
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1                  # context parallel: ranks sharing each sequence (2*cp chunks, load-balanced)
    zero: int = 0                # 0 DDP; ZeRO 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)
    dispatcher: str = "alltoall"  # ep > 1: alltoall, dedup (once per EP rank), allgather, hierarchical (once per node)
    debug_splits: bool = False   # check all-to-all split sizes across ranks (raises, never hangs)
    a2a_chunks: int = 1          # alltoall: expert chunks pipelined between async all-to-alls
    backend: str = "auto"        # process group backend: auto (nccl on CUDA, else gloo), gloo, nccl
    bucket_mb: float = 25.0      # gradient buckets reduced while backward runs
    grad_reduce_dtype: str = ""  # "" (the parameters' dtype) or "bfloat16" on the wire
    pp_schedule: str = "1f1b"    # pipeline schedule: "1f1b", "interleaved_1f1b" or "gpipe"
    pp_virtual: int = 1          # model chunks per pipeline rank (> 1: interleaved_1f1b)
    pp_layers: list[int] = field(default_factory=list)   # layers per chunk; empty: balanced
    timeout_s: float = 600.0     # seconds any collective may wait before the job fails
    gpus_per_node: int = 0       # ranks per node; 0: LOCAL_WORLD_SIZE from the launcher, else one node
    expert_placement: str = "contiguous"  # experts on EP ranks: contiguous, balanced, a JSON's path
    expert_replicas: int = 0     # replica slots per EP rank for hot experts (balanced, a file)
    placement_from: str = ""     # balanced: the run whose expert_load.jsonl gives the load
    placement_window: int = 0    # balanced: the last N recorded steps of that load; 0: all of them
    replace_every: int = 0       # re-place experts (balanced) every K steps from their load; 0: never

    def __post_init__(self):
        if self.dp < 0:
            raise ValueError(f"parallel.dp={self.dp} must be >= 1, or 0 for the rest of the world")
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero={self.zero} is not one of 0, 1, 2, 3")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"parallel.dispatcher={self.dispatcher!r} is not one of "
                             f"{', '.join(map(repr, DISPATCHERS))}")
        if self.a2a_chunks < 1:
            raise ValueError(f"parallel.a2a_chunks={self.a2a_chunks} must be >= 1")
        check_number("parallel.bucket_mb", self.bucket_mb, strict=True)
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule={self.pp_schedule!r} is not one of "
                             f"{', '.join(map(repr, SCHEDULES))}")
        if self.pp_virtual < 1:
            raise ValueError(f"parallel.pp_virtual={self.pp_virtual} must be >= 1")
        if self.pp_virtual > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ValueError(f"parallel.pp_virtual={self.pp_virtual} needs "
                             f"parallel.pp_schedule='interleaved_1f1b', not {self.pp_schedule!r}")
        if self.grad_reduce_dtype == "float16":
            raise ValueError("parallel.grad_reduce_dtype='float16' is not supported: summed "
                             "gradients overflow or flush to zero in float16 without loss "
                             "scaling; use 'bfloat16' (float32's range)")
        if self.grad_reduce_dtype not in ("", "float32", "bfloat16"):
            raise ValueError(f"parallel.grad_reduce_dtype={self.grad_reduce_dtype!r} is not one of "
                             "'' (the parameters' dtype), 'float32', 'bfloat16'")
        check_number("parallel.timeout_s", self.timeout_s, strict=True)
        if self.gpus_per_node < 0:
            raise ValueError(f"parallel.gpus_per_node={self.gpus_per_node} must be >= 0")
        self._check_placement()
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"parallel.backend={self.backend!r} is not one of 'auto', 'gloo', 'nccl'")
        # timeout_s: a datetime.timedelta overflows past ~10^14 s; 30 days is already no timeout
        check_at_most("parallel", self, {"dp": 1 << 20, "tp": 1 << 16, "pp": 1 << 12, "ep": 1 << 16, "cp": 1 << 12,
                                         "a2a_chunks": 1 << 12, "pp_virtual": 1 << 12,
                                         "bucket_mb": 1 << 20, "timeout_s": 30 * 86400,
                                         "gpus_per_node": 1 << 12, "expert_replicas": 1 << 12,
                                         "placement_window": 1 << 40, "replace_every": 1 << 40})

    def _check_placement(self):
        p = self.expert_placement
        if not p:
            raise ValueError("parallel.expert_placement is empty: give 'contiguous', 'balanced' "
                             "or the path of a placement JSON file")
        if min(self.expert_replicas, self.placement_window, self.replace_every) < 0:
            raise ValueError(f"parallel.expert_replicas={self.expert_replicas}, "
                             f"parallel.placement_window={self.placement_window} and "
                             f"parallel.replace_every={self.replace_every} must be >= 0")
        if self.dispatcher == "hierarchical" and (p != "contiguous" or self.replace_every):
            raise ValueError(f"parallel.dispatcher='hierarchical' needs parallel.expert_placement="
                             f"'contiguous' and no parallel.replace_every (its router groups are "
                             f"aligned to nodes by expert id), not {p!r}")
        if self.replace_every and self.zero:
            raise ValueError(f"parallel.replace_every={self.replace_every} needs parallel.zero=0, "
                             f"not {self.zero}: ZeRO shards the experts' rows by position")
        if p == "balanced" and not self.placement_from:
            raise ValueError("parallel.expert_placement='balanced' needs parallel.placement_from: "
                             "the run directory whose expert_load.jsonl gives the measured load")
        if self.placement_from and p != "balanced":
            raise ValueError(f"parallel.placement_from={self.placement_from!r} is only read by "
                             f"parallel.expert_placement='balanced', not {p!r}")
        if self.expert_replicas and p == "contiguous":
            raise ValueError(f"parallel.expert_replicas={self.expert_replicas} needs "
                             "parallel.expert_placement='balanced' or a placement file: the "
                             "contiguous placement has no replica slots")


@dataclass
class TrainConfig:
    steps: int = 200
    micro_batch_size: int = 8      # sequences per forward/backward (and per capacity group)
    global_batch_size: int = 16    # sequences per optimizer step
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1      # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0         # max global grad norm; 0 disables clipping
    dtype: str = "float32"         # float32, bfloat16 or float16 (float32 masters), float64 (exact tests)
    optim_state_dtype: str = "float32"  # AdamW moments: float32, or bfloat16 (half the state; maths stays float32)
    optimizer: str = "adamw"       # adamw, or muon (matrices; AdamW for embedding, head, 1-D: docs/optimizers.md)
    muon_momentum: float = 0.95    # muon: momentum of the buffer Newton-Schulz orthogonalizes
    muon_nesterov: bool = True     # muon: orthogonalize the Nesterov blend of gradient and momentum
    muon_ns_steps: int = 5         # muon: Newton-Schulz iterations (coefficients 3.4445, -4.7750, 2.0315)
    qk_clip: float = 0.0           # MuonClip's tau (Kimi K2: 100): clip W_q, W_k of heads whose max logit passed it; 0 off
    fp32_residual: bool = False    # bfloat16/float16: keep the residual stream float32 (autocast at matmuls)
    loss_scale: float = 0.0        # float16: initial dynamic scale (0: 2^16); else > 0: fixed scale
    activation_checkpointing: bool = False  # the older spelling of recompute = "full"
    recompute: str = "none"        # recompute in backward: none, full (blocks), attention, experts
    compile: bool = False          # torch.compile each block's maths, region by region (docs/gpus.md)
    compile_backend: str = "inductor"  # inductor (fused kernels); aot_eager, eager: trace only (debug)
    device: str = "auto"           # auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu, cuda
    seed: int = 0
    on_nonfinite: str = "skip"     # NaN/Inf loss or grad norm: "skip" the step or "stop" the run
    max_skipped_steps: int = 5     # more consecutive skipped steps than this: the run has diverged, stop
    eval_every: int = 0            # steps between validation losses (and the last step); 0: none
    eval_batches: int = 1          # global batches (global_batch_size sequences) per validation
    mtp_coeff: float = 0.3         # weight of the mean MTP loss (model.mtp_layers; DeepSeek-V3: 0.3, later 0.1)
    record_routing: str = ""       # DIR: write each step's expert choices there (docs/routing-replay.md)
    router_replay: str = ""        # DIR: route by the choices recorded there; the router still trains

    def __post_init__(self):
        for name in ("steps", "micro_batch_size", "global_batch_size", "seq_len", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every={self.eval_every} must be >= 0 (0: no validation)")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"train.global_batch_size={self.global_batch_size} must be a multiple "
                             f"of train.micro_batch_size={self.micro_batch_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"train.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.optim_state_dtype not in OPTIM_STATE_DTYPES:
            raise ValueError(f"train.optim_state_dtype={self.optim_state_dtype!r} is not one of "
                             f"{OPTIM_STATE_DTYPES} (the dtype AdamW stores its moments in)")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"train.optimizer={self.optimizer!r} is not one of 'adamw', 'muon'")
        if self.optimizer == "muon" and self.optim_state_dtype != "float32":
            raise ValueError(f"train.optim_state_dtype={self.optim_state_dtype!r} is for AdamW "
                             "alone; train.optimizer='muon' keeps its state float32")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"train.muon_momentum={self.muon_momentum} must be in [0, 1)")
        check_number("train.qk_clip", self.qk_clip)
        if not 1 <= self.muon_ns_steps <= 20:
            raise ValueError(f"train.muon_ns_steps={self.muon_ns_steps} must be in [1, 20]")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r} is not one of 'auto', 'cpu', 'cuda'")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"train.recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"train.compile_backend={self.compile_backend!r} is not one of "
                             f"{COMPILE_BACKENDS}")
        if self.activation_checkpointing and self.recompute not in ("none", "full"):
            raise ValueError(f"train.activation_checkpointing=true (full recompute) contradicts "
                             f"train.recompute={self.recompute!r}; set only train.recompute")
        if self.activation_checkpointing:
            self.recompute = "full"
        if self.on_nonfinite not in ("skip", "stop"):
            raise ValueError(f"train.on_nonfinite={self.on_nonfinite!r} is not one of 'skip', 'stop'")
        if self.max_skipped_steps < 0:
            raise ValueError(f"train.max_skipped_steps={self.max_skipped_steps} must be >= 0")
        check_number("train.lr", self.lr, strict=True)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "eps", "loss_scale", "mtp_coeff"):
            check_number(f"train.{name}", getattr(self, name))
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
        # The sampler seeds micro-batch i with seed * 1_000_003 + i, which torch takes up to 2^64.
        if not 0 <= self.seed < 1 << 32:
            raise ValueError(f"train.seed={self.seed} must be in [0, 2**32)")
        check_at_most("train", self, {"steps": MAX_COUNT - 1, "micro_batch_size": 1 << 20,
                                      "global_batch_size": 1 << 30, "seq_len": 1 << 22,
                                      "warmup_steps": MAX_COUNT - 1, "max_skipped_steps": MAX_COUNT,
                                      "eval_every": MAX_COUNT, "eval_batches": 1 << 20})
        if self.global_batch_size // self.micro_batch_size > 1 << 20:
            raise ValueError(f"train.global_batch_size={self.global_batch_size} / "
                             f"train.micro_batch_size={self.micro_batch_size} is more than "
                             f"{1 << 20:,} micro-batches per step")

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


@dataclass
class DataConfig:
    """What training reads. `tokens` takes a folder from `moepar data prepare` (or one raw/.npy
    token file) as data.path, or several as data.paths blended by data.weights."""
    source: str = "builtin"   # builtin (Python's own docs, no download), text (a UTF-8 file), tokens
    path: str = ""            # text: the file; tokens: a prepared folder, or a raw/.npy token file
    paths: list[str] = field(default_factory=list)   # tokens: several folders/files to blend
    weights: list[float] = field(default_factory=list)   # share of each data.paths entry; [] = by size
    token_dtype: str = "uint16"  # for raw token files
    pack: str = "none"        # "documents": attention, RoPE and balance within documents (docs/data.md)
    pad: bool = False         # with pack: windows of whole documents, padded (fine-tuning data)

    def __post_init__(self):
        if self.source not in DATA_SOURCES:
            raise ValueError(f"data.source={self.source!r} is not one of {DATA_SOURCES}")
        if self.pack not in DATA_PACKS:
            raise ValueError(f"data.pack={self.pack!r} is not one of {DATA_PACKS}")
        if self.pad and self.pack != "documents":
            raise ValueError("data.pad=true needs data.pack='documents' (padding is told apart "
                             "by its document number)")
        if self.pack != "none" and (self.source != "tokens" or not self.path):
            raise ValueError(f"data.pack={self.pack!r} reads the document boundaries of one "
                             "prepared folder: set data.source='tokens' and data.path (blends "
                             "of data.paths are not packed yet)")
        if self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"data.token_dtype={self.token_dtype!r} is not one of {TOKEN_DTYPES}")
        for name in ("path", "paths", "weights"):
            if getattr(self, name) and self.source == "builtin":
                raise ValueError(f"data.{name} is set but data.source='builtin' reads no files; "
                                 f"set data.source='text' or 'tokens', or drop data.{name}")
        if self.source == "text":
            if self.paths or self.weights:
                raise ValueError("data.paths and data.weights blend token data: they need "
                                 "data.source='tokens'")
            if not self.path:
                raise ValueError("data.source='text' needs data.path")
            if not os.path.isfile(self.path):
                raise ValueError(f"data.path={self.path!r} is not a file")
        if self.source == "tokens":
            self._check_tokens()

    def _check_tokens(self):
        if self.path and self.paths:
            raise ValueError("data.path and data.paths are both set; give one folder as "
                             "data.path, or several as data.paths")
        if not self.path and not self.paths:
            raise ValueError("data.source='tokens' needs data.path (a folder from `moepar data "
                             "prepare`, or a token file) or data.paths")
        named = ([("data.path", self.path)] if self.path
                 else [(f"data.paths[{k}]", p) for k, p in enumerate(self.paths)])
        seen = {}
        for name, path in named:
            if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "index.json")):
                raise ValueError(f"{name}={path!r} is a directory without index.json; prepare "
                                 f"it with `moepar data prepare ... --out {path}`")
            if not os.path.exists(path):
                raise ValueError(f"{name}={path!r} is not a file or a prepared folder")
            real = os.path.realpath(path)
            if real in seen:
                raise ValueError(f"{name}={path!r} repeats {seen[real]}; give each source once "
                                 "and weight it with data.weights")
            seen[real] = name
        if self.weights:
            if not self.paths:
                raise ValueError("data.weights needs data.paths (one weight per path)")
            if len(self.weights) != len(self.paths):
                raise ValueError(f"data.weights has {len(self.weights)} entries, data.paths has "
                                 f"{len(self.paths)}: give one weight per path")
            for k, w in enumerate(self.weights):
                check_number(f"data.weights[{k}]", w, strict=True)


@dataclass
class RunDirConfig:
    """The `[run]` section: where the run lives and how often it reports and saves."""
    dir: str = "runs/tiny"
    log_every: int = 10
    checkpoint_every: int = 100   # steps; the last step is always saved; 0 saves only the last
    keep_checkpoints: int = 2     # newest complete checkpoints kept; 0 keeps all
    resume: bool | str = False    # continue from the newest checkpoint in dir/checkpoints; "auto": if there is one
    resume_from: str = ""         # or from this checkpoint directory
    init_from: str = ""           # start from these weights (e.g. a converted HF model): step 0, new optimizer
    overwrite: bool = False       # allow a fresh run in a dir that holds a previous run (its checkpoints go)
    allow_changes: list[str] = field(default_factory=list)  # resume: config keys that may differ from the checkpoint's
    async_checkpoint: bool = False  # copy to host memory, write in the background while training
    tensorboard: bool = True
    tb_image_every: int = 10      # steps between TensorBoard load heatmaps (and step 1); 0: none
    collapse_dead_steps: int = 100  # alarm when an expert gets no token this many steps in a row; 0: off
    collapse_min_entropy: float = 0.05  # alarm when a layer's router entropy / log E is below; 0: off

    def __post_init__(self):
        if not self.dir:
            raise ValueError("run.dir must not be empty")
        for name in ("dir", "resume_from", "init_from"):
            if "\0" in getattr(self, name):
                raise ValueError(f"run.{name}={getattr(self, name)!r} holds a NUL byte")
        if os.path.lexists(self.dir) and not os.path.isdir(self.dir):
            raise ValueError(f"run.dir={self.dir!r} exists and is not a directory (a run "
                             "directory holds config.toml, metrics.jsonl, checkpoints/, ...)")
        if isinstance(self.resume, str):
            if self.resume.lower() != "auto":
                raise ValueError(f"run.resume={self.resume!r} must be true, false or \"auto\" "
                                 "(resume when a complete checkpoint exists, else start fresh)")
            self.resume = "auto"
        for name in ("log_every", "checkpoint_every", "keep_checkpoints", "tb_image_every",
                     "collapse_dead_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"run.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.collapse_min_entropy <= 1:
            raise ValueError(f"run.collapse_min_entropy={self.collapse_min_entropy} must be in "
                             "[0, 1] (router entropy over log(num_experts); 0 turns it off)")
        for name in ("resume_from", "init_from"):
            path = getattr(self, name)
            if path and not os.path.isdir(path):
                raise ValueError(f"run.{name}={path!r} is not a directory")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunDirConfig = field(default_factory=RunDirConfig)

    def __post_init__(self):
        self.run.allow_changes = config_keys(self.run.allow_changes, "run.allow_changes")
        if self.model.num_experts % self.parallel.ep:
            raise ValueError(f"model.num_experts={self.model.num_experts} must be divisible by "
                             f"parallel.ep={self.parallel.ep}")
        self.router.check_experts(self.model.num_experts, self.model.top_k)
        p = self.parallel
        if p.pp > 1 or p.pp_layers:
            split_layers(self.model.num_layers, p.pp, p.pp_virtual, p.pp_layers or None)
        if p.pp > 1 and self.model.tie_embeddings:
            raise ValueError(f"model.tie_embeddings=true with parallel.pp={p.pp}: the embedding "
                             "(first stage) and the head (last stage) would share a weight across "
                             "ranks; set model.tie_embeddings=false or parallel.pp=1")
        if p.tp > 1:
            check_tp(self.model, p.tp, self.train.seq_len)
            if self.router.type != "topk":
                raise ValueError(f"router.type={self.router.type!r} with parallel.tp={p.tp} is not "
                                 "supported (each expert would need every slice's scores); use "
                                 "router.type='topk'")
        if self.model.mtp_layers and p.tp > 1:
            raise ValueError(f"model.mtp_layers={self.model.mtp_layers} with parallel.tp={p.tp} is "
                             "not supported (the MTP blocks are not tensor-parallel); use "
                             "parallel.tp=1 or model.mtp_layers=0")
        if self.model.mtp_layers >= self.train.seq_len:
            raise ValueError(f"model.mtp_layers={self.model.mtp_layers} must be < train.seq_len="
                             f"{self.train.seq_len} (depth k predicts k+1 tokens ahead)")
        check_routing_replay(self)
        check_cp(p.cp, p.tp, self.train.seq_len, self.router.type, self.train.compile,
                 self.data.pack, self.train.qk_clip)
        if p.cp > 1 and (self.model.mtp_layers or self.train.record_routing or
                         self.train.router_replay):
            raise ValueError(f"parallel.cp={p.cp} with model.mtp_layers={self.model.mtp_layers}, "
                             f"train.record_routing={self.train.record_routing!r}, "
                             f"train.router_replay={self.train.router_replay!r}: each cp rank "
                             "holds two chunks of a sequence, and MTP's shifted targets and the "
                             "recorded positions need whole sequences; use parallel.cp=1 or "
                             "turn them off")
        if p.dispatcher == "hierarchical" and p.gpus_per_node:   # (0: the launcher's, build_dims)
            node_layout(p.ep, p.gpus_per_node, self.model.num_experts, self.router.n_group)
        if p.pp == 1 and p.pp_virtual > 1:
            raise ValueError(f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp > 1")
        if self.train.qk_clip > 0 and self.model.qk_norm != "none":
            raise ValueError(f"train.qk_clip={self.train.qk_clip} with model.qk_norm="
                             f"{self.model.qk_norm!r}: the q/k norm undoes the clip's scaling of "
                             "W_q and W_k; set one of them off")
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                             f"{self.model.max_seq_len}")
        if self.parallel.backend == "gloo" and self.train.device == "cuda":
            raise ValueError("parallel.backend='gloo' with train.device='cuda': gloo's all-to-all "
                             "runs on CPU tensors only; use parallel.backend='nccl' (or auto)")
        if self.parallel.backend == "nccl" and self.train.device == "cpu":
            raise ValueError("parallel.backend='nccl' with train.device='cpu': NCCL needs CUDA "
                             "tensors; use parallel.backend='gloo' (or auto)")
        if self.data.pack != "none" and self.model.mtp_layers:
            raise ValueError(f"data.pack={self.data.pack!r} with model.mtp_layers="
                             f"{self.model.mtp_layers}: the MTP depths do not mask documents yet; "
                             "use data.pack='none' or model.mtp_layers=0")
        if self.data.pad and self.router.type != "topk":
            raise ValueError(f"data.pad=true with router.type={self.router.type!r}: experts "
                             "would choose padding; use router.type='topk'")
        if self.data.source in ("builtin", "text") and self.model.vocab_size < 256:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} must be >= 256 for the "
                             f"byte-level tokenizer (data.source={self.data.source!r})")


def check_routing_replay(cfg: "RunConfig"):
    """train.record_routing / train.router_replay need every rank to route whole sequences of
    every MoE layer with top-k routing (moepar/routing.py)."""
    t, p = cfg.train, cfg.parallel
    key = "train.record_routing" if t.record_routing else "train.router_replay"
    if not (t.record_routing or t.router_replay):
        return
    if t.record_routing and t.router_replay:
        raise ValueError("train.record_routing and train.router_replay are both set: a replayed "
                         "run's choices are the recorded ones; set one")
    if p.pp > 1 or p.tp > 1:
        raise ValueError(f"{key} with parallel.pp={p.pp}, parallel.tp={p.tp}: routing is "
                         "recorded and replayed by whole sequences of every MoE layer; use "
                         "pp = tp = 1 (any dp, ep and zero)")
    if cfg.data.pack != "none" or cfg.model.mtp_layers:
        raise ValueError(f"{key} with data.pack={cfg.data.pack!r}, model.mtp_layers="
                         f"{cfg.model.mtp_layers}: recorded routing covers every position of "
                         "whole sequences of the main layers; use data.pack='none' and "
                         "model.mtp_layers=0")
    if cfg.router.type != "topk" or cfg.model.num_experts == 0:
        raise ValueError(f"{key} needs token-choice routing (router.type='topk', "
                         f"model.num_experts > 0), got router.type={cfg.router.type!r}")


def config_keys(names: list[str], what: str) -> list[str]:
    """Full 'section.key' names for `names`, each 'section.key' or a bare key that names one field
    of one section ('top_k' -> 'model.top_k'); ValueError naming `what` otherwise."""
    hints = typing.get_type_hints(RunConfig)
    known = [f"{s}.{f.name}" for s in hints for f in dataclasses.fields(hints[s])]
    out = []
    for name in names:
        name = name.strip()
        matches = [name] if name in known else [k for k in known if k.split(".", 1)[1] == name]
        if len(matches) != 1:
            hint = (f"it could be {', '.join(matches)}" if matches
                    else "keys are written section.key, e.g. train.seed")
            raise ValueError(f"{what}: {name!r} is not {'one' if matches else 'a'} config key "
                             f"({hint})")
        out.append(matches[0])
    return out


# ---- loading -------------------------------------------------------------------------------

def _section_types(cls) -> dict[str, type]:
    return typing.get_type_hints(cls)


def _convert(key: str, value, hint):
    """Converts a TOML or command-line value to the field's type, or raises naming the key."""
    allowed_none, members = False, None
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        allowed_none = len(args) < len(typing.get_args(hint))
        if allowed_none and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        members = args
        for member in args[:-1]:          # each member in turn (bool | str: true, false, "auto")
            try:
                return _convert(key, value, member)
            except ValueError:
                pass
        hint = args[-1]
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):   # from the command line: "1,3,5" or "[1,3,5]" ("" for none)
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [v for v in text.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{key}={value!r} is not a list")
        return [_convert(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
            raise ValueError
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if hint is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    kind = " or ".join(m.__name__ for m in members or [hint]) + (" or none" if allowed_none else "")
    raise ValueError(f"{key}={value!r} is not a valid {kind}")


def _build(tree: dict, source: str, overridden: set = frozenset()) -> RunConfig:
    """The RunConfig of `tree`; errors name where each key came from: the `source` file, or the
    command line for the (section, key) pairs in `overridden`."""
    sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    hints = typing.get_type_hints(RunConfig)
    built = {}
    for name, values in tree.items():
        if name not in sections:
            where = "command line" if any(s == name for s, _ in overridden) else source
            raise ValueError(f"{where}: unknown config section [{name}]; allowed: "
                             f"{', '.join(sections)}")
        if not isinstance(values, dict):
            raise ValueError(f"{source}: [{name}] must be a table of key = value")
        cls = hints[name]
        field_hints = _section_types(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in field_hints:
                where = "command line" if (name, key) in overridden else source
                if f"{name}.{key}" in RENAMED:
                    raise ValueError(f"{where}: config key '{name}.{key}' is gone: "
                                     f"{RENAMED[f'{name}.{key}']}")
                raise ValueError(f"{where}: unknown config key '{name}.{key}'; allowed keys in "
                                 f"[{name}]: {', '.join(field_hints)}")
            kwargs[key] = _convert(f"{name}.{key}", value, field_hints[key])
        built[name] = cls(**kwargs)
    return RunConfig(**built)


def model_sections(config, where: str) -> tuple[ModelConfig, RouterConfig]:
    """The [model] and [router] sections of a saved config (a checkpoint's state.json), each
    value converted and checked as a TOML file's would be; ValueError naming `where` and the
    key otherwise (an unknown key: a checkpoint of another moepar)."""
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError(f"{where} has no model config (a 'config' object with a 'model' section)")
    built = []
    try:
        for name, cls in (("model", ModelConfig), ("router", RouterConfig)):
            values = config.get(name, {})
            if not isinstance(values, dict):
                raise ValueError(f"[{name}] must be an object of key = value")
            hints = _section_types(cls)
            unknown = sorted(set(values) - set(hints))
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(f'{name}.{k}' for k in unknown)} "
                                 "(written by another moepar version?)")
            built.append(cls(**{k: _convert(f"{name}.{k}", v, hints[k]) for k, v in values.items()}))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return built[0], built[1]


def parse_overrides(args: list[str]) -> dict:
    """['--model.dim=64', '--train.steps', '5'] -> {'model': {'dim': '64'}, 'train': {'steps': '5'}}."""
    tree: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ValueError(f"override {arg!r} is not of the form --section.key=value")
        if "=" in arg:
            path, value = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            path, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ValueError(f"override {arg!r} has no value")
        section, key = path.split(".", 1)
        tree.setdefault(section, {})[key] = value
        i += 1
    return tree


def packaged_examples() -> dict[str, str]:
    """The example configs installed with moepar (the checkout's examples/*.toml): {name: path}."""
    return {p.name[:-len(".toml")]: str(p) for p in files("moepar.examples").iterdir()
            if p.name.endswith(".toml")}


def config_path(path: str) -> str:
    """A path as is (read_toml refuses what is not a regular file); a bare name that is nothing
    on disk ('tiny', 'tiny.toml') names a packaged example."""
    if "\0" in path:
        raise ValueError(f"config file {path!r} holds a NUL byte")
    if os.path.lexists(path) or os.path.dirname(path):
        return path
    examples = packaged_examples()
    name = path[:-len(".toml")] if path.endswith(".toml") else path
    if name not in examples:
        raise ValueError(f"config file {path!r} does not exist, and it is not one of the packaged "
                         f"examples: {', '.join(sorted(examples))}")
    return examples[name]


def load_config(path: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Reads TOML (a file, or a packaged example's name), applies overrides, and validates
    everything. Raises ValueError."""
    tree: dict = {}
    if path:
        path = config_path(path)
        tree = read_toml(path)       # FileError (a ValueError) naming the file
    overridden = set()
    for section, values in parse_overrides(list(overrides)).items():
        if not isinstance(tree.get(section, {}), dict):
            raise ValueError(f"[{section}] must be a table")
        tree.setdefault(section, {}).update(values)
        overridden |= {(section, key) for key in values}
    try:
        return _build(tree, path or "command line", overridden)
    except ValueError as e:
        raise ValueError(str(e)) from None


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def _toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON's string escapes are TOML basic-string escapes (control characters as \\uXXXX).
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal config."""
    return sections_toml({f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig)})


def sections_toml(sections: dict) -> str:
    """TOML for {section name: section dataclass}."""
    lines = []
    for section, obj in sections.items():
        values = dataclasses.asdict(obj)
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _field_comments(cls) -> dict[str, str]:
    """{field: its trailing `# comment`} from the dataclass source (the one place keys are
    described), or {} when the source is not available."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    comments = {}
    for line in lines:
        match = re.match(r"^\s{4}(\w+)\s*:[^#]*#\s*(.+)$", line)
        if match:
            comments[match.group(1)] = match.group(2).strip()
    return comments


def config_reference() -> str:
    """Every section and key with its default and meaning: `moepar train --help` prints this."""
    hints = typing.get_type_hints(RunConfig)
    lines = []
    for section in dataclasses.fields(RunConfig):
        cls = hints[section.name]
        lines.append(f"  [{section.name}]")
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            text = f"    {section.name}.{f.name} = {_toml_value(default)}"
            if f.name in comments:
                text = f"{text:<52} # {comments[f.name]}"
            lines.append(text)
    return "\n".join(lines)
