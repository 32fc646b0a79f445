"""The training loop: micro-batches, gradient accumulation, reduction, clipping, AdamW, logging,
checkpoints; one code path for 1 and N ranks.

One optimizer step = `train.global_batch_size / train.micro_batch_size` micro-batches, split over
the dp ranks (each rank takes a contiguous block). Each micro-batch is one capacity group, so
drops do not depend on the layout. A rank weights its micro-batches' mean cross-entropy by
1/(its micro-batches) and MoE aux losses are injected with the same weight; averaging over dp
then gives the mean over all micro-batches, as on one process.
"""

import contextlib
import dataclasses
import math
import os
import shutil
import time

import torch
import torch.distributed as dist

from moepar.checkpoint import (Owner, checkpoint_step, complete_steps, latest_checkpoint,
                               load_checkpoint, recover_interrupted, save_checkpoint)
from moepar.config import RunConfig, to_dict, to_toml
from moepar.data import WindowSampler, check_token_range, load_tokens
from moepar.layers import TopKRouter, Transformer
from moepar.metrics import MetricsWriter, StepStats
from moepar.parallel import ParallelDims, data_parallel, parallelize
from moepar.parallel.data import clip_grad_norm, grad_norm_groups
from moepar.parallel.tensor import (reduce_sequence_parallel_grads, tp_norm_parameters,
                                    tp_shard_spec)
from moepar.parallel.vocab import vocab_parallel_cross_entropy
from moepar.parallel.schedules import PipelineRunner, check_schedule, default_loss

__all__ = ["Trainer", "lr_at", "NonFiniteError", "build_dims"]

_PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.float32, "float64": torch.float64}


class NonFiniteError(RuntimeError):
    """Raised with train.on_nonfinite='stop' when a step's loss or grad norm is NaN or Inf."""


def lr_at(step: int, cfg) -> float:
    """Learning rate for 1-based `step`: linear warmup to train.lr, then cosine to lr*min_lr_ratio."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def adamw_factory(cfg):
    """make_adamw(decay, no_decay): AdamW with weight decay on matrices (and expert stacks) only."""
    return lambda decay, no_decay: _adamw(decay, no_decay, cfg)


def _adamw(decay, no_decay, cfg):
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             foreach=True)


def build_dims(cfg: RunConfig, world_size: int) -> ParallelDims:
    """The layout for this world, validated against the batch sizes; raises before any collective."""
    p = cfg.parallel
    dims = ParallelDims.resolve(world_size, p.pp, p.dp, p.tp, p.ep, cfg.model.num_experts)
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


def _device(cfg) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device='cuda' but CUDA is not available")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but this node has "
                             f"{torch.cuda.device_count()} CUDA device(s): start at most that "
                             "many processes per node")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Trainer:
    """Builds the model, data and optimizer from a validated RunConfig; `run()` trains."""

    def __init__(self, cfg: RunConfig, log=print):
        self.cfg = cfg
        tcfg = cfg.train
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.dims = build_dims(cfg, world_size)
        self.log = log if self.rank == 0 else (lambda _msg: None)
        self.device = _device(cfg)
        # Data errors surface here, on every rank, before any process group exists.
        tokens = load_tokens(cfg.data)
        check_token_range(tokens, cfg.model.vocab_size, f"data.source={cfg.data.source}")
        self.sampler = WindowSampler(tokens, tcfg.seq_len, tcfg.micro_batch_size, tcfg.seed,
                                     cfg.model.vocab_size, name=f"data.source={cfg.data.source}")
        self.meshes = None
        if world_size > 1:
            if not dist.is_initialized():
                backend = cfg.parallel.backend
                if backend == "auto":
                    backend = "nccl" if self.device.type == "cuda" else "gloo"
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                dist.init_process_group(backend)
            self.meshes = self.dims.build_meshes(self.device.type)
        coords = self.dims.coords(self.rank)
        # One replica per pipeline stage writes: dense tensors where dp == tp == 0, experts where
        # edp == 0.
        self.tp_group = self.meshes.group("tp") if self.dims.tp > 1 else None
        self.owner = Owner(self.rank, world_size, writes_experts=coords.edp == 0,
                           writes_dense=coords.dp == 0 and coords.tp == 0,
                           tp_group=self.tp_group)
        self.num_micro = tcfg.global_batch_size // tcfg.micro_batch_size
        self.num_local_micro = self.num_micro // self.dims.dp
        self.first_micro = coords.dp * self.num_local_micro
        self.ckpt_root = os.path.join(cfg.run.dir, "checkpoints")
        resume_path = self._resume_path()
        # Every rank builds the full model from the same seed, then keeps its shard.
        torch.manual_seed(tcfg.seed)
        model = Transformer(cfg.model, cfg.router).to(_PARAM_DTYPES[tcfg.dtype])
        self.model = parallelize(model, cfg.parallel, self.dims, self.meshes, self.rank,
                                 tcfg.activation_checkpointing, tcfg.seq_len).to(self.device)
        if self.tp_group is not None:    # tensor-parallel shards gather/slice in checkpoints
            self.owner.tp_specs = tp_shard_spec(self.model)
        self.model.set_aux_loss_scale(1.0 / self.num_local_micro)
        self.num_moe_layers = sum(map(cfg.model.is_moe_layer, range(cfg.model.num_layers)))
        # This rank's MoE layers' positions among all of the model's (all of them without pp).
        self.moe_indices = (self.model.moe_indices() if self.dims.pp > 1
                            else list(range(self.num_moe_layers)))
        self.runner = None
        if self.dims.pp > 1:
            self.runner = PipelineRunner(self.model, self.meshes.group("pp"),
                                         cfg.parallel.pp_schedule, self.num_local_micro,
                                         loss_fn=self.loss_fn, autocast=self._autocast)
        # Data parallelism / ZeRO wraps the parameters last; it also decides what AdamW steps.
        compute = torch.bfloat16 if tcfg.dtype == "bfloat16" else None
        self.sync, self.optimizer = data_parallel(self.model, cfg.parallel, self.dims, self.meshes,
                                                  adamw_factory(tcfg), compute)
        # The norm's tp groups, from the parameters as wrapped (FSDP swaps in new ones).
        self._tp_split = (tp_norm_parameters(self.model, self.tp_group)
                          if self.tp_group is not None else None)
        self.step = 0
        if resume_path:
            state = load_checkpoint(resume_path, self.model, self.optimizer, self.owner)
            self.step, self.sampler.position = state["step"], state["data_position"]
            self.log(f"resumed from {resume_path} at step {self.step}")
        elif cfg.run.init_from:
            load_checkpoint(cfg.run.init_from, self.model, None, self.owner)
            self.log(f"initialised weights from {cfg.run.init_from}")
        self.log(f"layout: {self.dims.describe()}; zero {cfg.parallel.zero}; "
                 f"{self.num_local_micro} micro-batch(es) of "
                 f"{tcfg.micro_batch_size} per rank per step; device {self.device}")

    def _resume_path(self) -> str | None:
        """The checkpoint to resume from, or None; refuses to clobber a run by accident."""
        run = self.cfg.run
        if self.rank == 0:
            for message in recover_interrupted(self.ckpt_root):
                self.log(f"checkpoints: {message}")
        self.owner.barrier()
        existing = complete_steps(self.ckpt_root)
        doomed, path = [], None
        if run.resume_from:
            step = checkpoint_step(run.resume_from)
            doomed = [s for s in existing if step is not None and s > step]
            if doomed and not run.overwrite:
                raise ValueError(f"run.dir={run.dir!r} holds checkpoints after step {step} of "
                                 f"run.resume_from (steps {doomed}); they would be resumed by "
                                 "--run.resume later or pruned. Pass --run.overwrite=true to "
                                 "delete them, or use another run.dir")
            path = run.resume_from
        elif run.resume:
            path = latest_checkpoint(self.ckpt_root)  # none yet: a fresh start
        elif existing:
            if not run.overwrite:
                raise ValueError(f"run.dir={run.dir!r} already holds checkpoints (steps {existing}); "
                                 "pass --run.resume=true to continue it, --run.overwrite=true to "
                                 "replace it, or choose another run.dir")
            doomed = existing
        if doomed:
            self.owner.barrier()       # every rank has looked before anything goes
            if self.rank == 0:
                for step in doomed:
                    shutil.rmtree(os.path.join(self.ckpt_root, f"step_{step}"))
            self.owner.barrier()
        return path

    def _autocast(self):
        if self.cfg.train.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _micro_batch(self, inputs_BS, targets_BS, stats: StepStats, last: bool = True):
        inputs_BS, targets_BS = inputs_BS.to(self.device), targets_BS.to(self.device)
        self.sync.before_backward(last)
        with self._autocast():
            logits_BSV, moe_outputs = self.model(inputs_BS)
        loss = self.loss_fn(logits_BSV, targets_BS)
        (loss / self.num_local_micro).backward()
        self.sync.after_backward(last)
        stats.add(moe_outputs, self.cfg.router)
        return loss.detach()

    def forward_backward(self, stats: StepStats) -> torch.Tensor:
        """This rank's micro-batches of one step, gradients reduced; returns their loss sum
        (under pp: zero except on the last stage; the step-end reduction sums over pp)."""
        base = self.sampler.position + self.first_micro
        if self.runner is not None:
            return self._pipeline_step(base, stats)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(self.num_local_micro):
            # Gradients reduce while the last backward runs (ZeRO-2: every backward).
            last = i == self.num_local_micro - 1
            loss_sum += self._micro_batch(*self.sampler.batch(base + i), stats, last)
        self.sampler.position += self.num_micro
        return loss_sum

    def loss_fn(self, logits_BSV, targets_BS):
        """Mean cross-entropy in float32 or wider; vocabulary-parallel under tp (logits stay split)."""
        if self.tp_group is None:
            return default_loss(logits_BSV, targets_BS)
        logits_BSV = logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
        return vocab_parallel_cross_entropy(logits_BSV, targets_BS, self.tp_group,
                                            self.cfg.model.vocab_size)

    def _pipeline_step(self, base: int, stats: StepStats) -> torch.Tensor:
        batches = [self.sampler.batch(base + i) for i in range(self.num_local_micro)]
        final_backward = [a for a in self.runner.order if a.kind == "B"][-1]
        last_micro = self.num_local_micro - 1

        def around(action, after: bool):
            if action.kind == "B":
                hook = self.sync.after_backward if after else self.sync.before_backward
                hook(action.micro == last_micro, action == final_backward)

        loss_sum, moe_outputs = self.runner.run(
            [b[0] for b in batches], [b[1] for b in batches],
            before_action=lambda a: around(a, False), after_action=lambda a: around(a, True))
        for outs in moe_outputs:
            stats.add(outs, self.cfg.router, self.moe_indices)
        self.sampler.position += self.num_micro
        return loss_sum

    def train_step(self) -> dict:
        """One optimizer step over this rank's micro-batches; returns the global metrics record."""
        tcfg = self.cfg.train
        start = time.perf_counter()
        stats = StepStats(self.num_moe_layers, self.cfg.model.num_experts, self.device)
        loss_sum = self.forward_backward(stats)
        if self.tp_group is not None:   # replicated parameters saw 1/tp of the tokens each
            reduce_sequence_parallel_grads(self.model, self.tp_group, self.sync.grad_view)
        # Statistics and the loss of all dp ranks (and pipeline stages), reduced on every rank.
        stats.reduce(self.meshes.group("dp") if self.meshes else None, extra=[loss_sum],
                     stage_group=self.meshes.group("pp") if self.dims.pp > 1 else None,
                     slice_group=self.tp_group)
        max_norm = tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf")
        groups = grad_norm_groups(self.model, self.sync, self.dims, self._tp_split)
        grad_norm = float(clip_grad_norm(groups, max_norm, self.meshes, self.device))
        loss = float(loss_sum) / self.num_micro
        self.step += 1
        lr = lr_at(self.step, tcfg)
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            message = (f"step {self.step}: non-finite loss={loss} or grad_norm={grad_norm}; "
                       f"{'stopping' if tcfg.on_nonfinite == 'stop' else 'step skipped'}, "
                       "parameters unchanged")
            self.log(message)
            if tcfg.on_nonfinite == "stop":
                raise NonFiniteError(message)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._update_expert_bias(stats)
        elapsed = time.perf_counter() - start
        tokens = tcfg.global_batch_size * tcfg.seq_len
        record = {"step": self.step, "loss": loss, **stats.summary(), "grad_norm": grad_norm,
                  "lr": lr, "tokens_per_s": tokens / elapsed, "skipped": skipped}
        self.last_stats = stats
        return record

    def _update_expert_bias(self, stats: StepStats):
        for layer, moe in zip(self.moe_indices, self.model.moe_layers()):
            router = moe.router
            if isinstance(router, TopKRouter) and router.cfg.bias_update_rate > 0:
                router.update_bias(stats.tokens_LE[layer])

    def expert_bias_LE(self):
        """Every MoE layer's selection bias [L, E], or None; a collective over pp under pp > 1."""
        if self.cfg.router.bias_update_rate == 0 or self.cfg.router.type != "topk" \
                or not self.num_moe_layers:
            return None
        bias_LE = torch.zeros(self.num_moe_layers, self.cfg.model.num_experts,
                              dtype=torch.float64, device=self.device)
        for layer, moe in zip(self.moe_indices, self.model.moe_layers()):
            bias_LE[layer] = moe.router.expert_bias_E.to(bias_LE)
        if self.dims.pp > 1:
            dist.all_reduce(bias_LE, group=self.meshes.group("pp"))
        return bias_LE

    def save(self) -> str:
        state = {"step": self.step, "data_position": self.sampler.position, "config": to_dict(self.cfg),
                 "layout": self.dims.describe()}
        return save_checkpoint(self.ckpt_root, self.step, self.model, self.optimizer, state,
                               keep=self.cfg.run.keep_checkpoints, owner=self.owner)

    def run(self) -> list[dict]:
        """Trains to train.steps, logging and checkpointing; returns this call's records."""
        cfg = self.cfg
        writer = None
        if self.rank == 0:
            os.makedirs(cfg.run.dir, exist_ok=True)
            # One-shot flags are not part of the run: reusing this file must not resume from a
            # stale path or delete checkpoints.
            saved = dataclasses.replace(cfg, run=dataclasses.replace(
                cfg.run, resume=False, resume_from="", overwrite=False))
            with open(os.path.join(cfg.run.dir, "config.toml"), "w") as f:
                f.write(to_toml(saved))
            writer = MetricsWriter(cfg.run.dir, cfg.run.tensorboard, resume_step=self.step,
                                   ep=self.dims.ep, model=cfg.model,
                                   image_every=cfg.run.tb_image_every)
        records = []
        try:
            while self.step < cfg.train.steps:
                record = self.train_step()
                records.append(record)
                bias_LE = self.expert_bias_LE()   # every rank; expert_load.jsonl keeps it
                if writer is not None:
                    writer.write(record, self.last_stats, bias_LE)
                if cfg.run.log_every and (self.step % cfg.run.log_every == 0 or self.step == 1
                                          or self.step == cfg.train.steps):
                    self.log(progress_line(record, cfg.train.steps))
                every = cfg.run.checkpoint_every
                if self.step == cfg.train.steps or (every and self.step % every == 0):
                    path = self.save()
                    if self.step == cfg.train.steps:
                        self.log(f"saved {path}")
        finally:
            if writer is not None:
                writer.close()
        return records


def progress_line(r: dict, total_steps: int) -> str:
    return (f"step {r['step']:>5}/{total_steps} | loss {r['loss']:.4f} | aux {r['aux_loss']:.4f} | "
            f"z {r['z_loss']:.2e} | gnorm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s'] / 1000:.1f}k tok/s | load max/mean {r['max_load_ratio']:.2f} | "
            f"drop {100 * r['drop_fraction']:.1f}%")
