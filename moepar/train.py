"""The training loop: micro-batches, gradient accumulation, clipping, AdamW, logging,
checkpoints; one code path for 1 and N ranks and for every layout.

The model is built on the meta device and handed to `moepar.parallel.parallelize`, which shards
it, materializes this rank's shards on its device and returns the handle (`ParallelModel`) that
runs each step: the trainer never branches on the layout.

One optimizer step = `train.global_batch_size / train.micro_batch_size` micro-batches, split over
the dp ranks (each rank takes a contiguous block). Each micro-batch is one capacity group, so
drops do not depend on the layout. A rank weights its micro-batches' mean cross-entropy by
1/(its micro-batches) and MoE aux losses are injected with the same weight; averaging over dp
then gives the mean over all micro-batches, as on one process.
"""

import dataclasses
import math
import os
import shutil
import time

import torch

from moepar.checkpoint import (PendingSave, checkpoint_step, complete_steps, latest_checkpoint,
                               load_checkpoint, read_state, recover_interrupted)
from moepar.config import RunConfig, to_dict, to_toml
from moepar.data import build_sampler, check_same_dataset
from moepar.infer.evaluate import Validation
from moepar.launch import init_process_group, select_device
from moepar.layers import Transformer
from moepar.metrics import MetricsWriter, StepStats
from moepar.parallel import Options, ParallelDims, parallelize
from moepar.parallel.schedules import check_schedule

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


def adamw_factory(cfg, fused: bool = False):
    """make_adamw(decay, no_decay): AdamW with weight decay on matrices (and expert stacks) only;
    the fused kernel on CUDA."""
    def make(decay, no_decay):
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        kind = {"fused": True} if fused else {"foreach": True}
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 **kind)
    return make


def build_dims(cfg: RunConfig, world_size: int) -> ParallelDims:
    """The layout for this world, validated against the batch sizes; raises before any collective."""
    p = cfg.parallel
    node = p.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    dims = ParallelDims.resolve(world_size, p.pp, p.dp, p.tp, p.ep, cfg.model.num_experts,
                                gpus_per_node=node if node < world_size else 0)
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


class Trainer:
    """Builds the data, the layout and the parallel model from a validated RunConfig; `run()` trains."""

    def __init__(self, cfg: RunConfig, log=print):
        self.cfg = cfg
        tcfg = cfg.train
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.dims = build_dims(cfg, world_size)
        self.log = log if self.rank == 0 else (lambda _msg: None)
        self.device = select_device(tcfg.device, cfg.parallel.backend)
        # Data errors surface here, on every rank, before any process group exists.
        self.sampler = build_sampler(cfg)
        self.validation = Validation(cfg, self.dims, self.rank) if tcfg.eval_every else None
        init_process_group(cfg.parallel, self.device, world_size)
        self.layout = self.dims.bind(self.rank, self.device)
        coords = self.layout.coords
        self.num_micro = tcfg.global_batch_size // tcfg.micro_batch_size
        self.num_local_micro = self.num_micro // self.dims.dp
        self.first_micro = coords.dp * self.num_local_micro
        self.ckpt_root = os.path.join(cfg.run.dir, "checkpoints")
        resume_path = self._resume_path()
        # The whole model exists only as shapes; each rank allocates and draws its own shards.
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.router, seed=tcfg.seed)
        model = model.to(_PARAM_DTYPES[tcfg.dtype])
        options = Options(cfg.parallel, adamw_factory(tcfg, fused=self.device.type == "cuda"),
                          num_micro=self.num_local_micro, vocab_size=cfg.model.vocab_size,
                          seq_len=tcfg.seq_len,
                          activation_checkpointing=tcfg.activation_checkpointing,
                          compute_dtype=torch.bfloat16 if tcfg.dtype == "bfloat16" else None,
                          seed=tcfg.seed)
        self.engine = parallelize(model, self.layout, options)
        self.step = 0
        if resume_path:
            # Another dataset is refused before anything is read (the state file is small).
            check_same_dataset(read_state(resume_path).get("dataset"), self.sampler.fingerprint)
            state = load_checkpoint(resume_path, self.engine, optimizer=True)
            self.step, self.sampler.position = state["step"], state["data_position"]
            self.log(f"resumed from {resume_path} at step {self.step}")
        elif cfg.run.init_from:
            load_checkpoint(cfg.run.init_from, self.engine, restore_rng=False)
            self.log(f"initialised weights from {cfg.run.init_from}")
        if self.dims.gpus_per_node:
            self.log(f"nodes: {self.dims.describe_nodes()}")
        self.log(f"layout: {self.dims.describe()}; zero {cfg.parallel.zero}; "
                 f"{self.num_local_micro} micro-batch(es) of "
                 f"{tcfg.micro_batch_size} per rank per step; device {self.device}")

    # The handle's parts, by the names tests and benchmarks use.
    model = property(lambda self: self.engine.model)
    optimizer = property(lambda self: self.engine.optimizer)
    sync = property(lambda self: self.engine.sync)
    runner = property(lambda self: self.engine.runner)
    meshes = property(lambda self: self.layout.meshes)

    def _resume_path(self) -> str | None:
        """The checkpoint to resume from, or None; refuses to clobber a run by accident."""
        run = self.cfg.run
        if self.rank == 0:
            for message in recover_interrupted(self.ckpt_root):
                self.log(f"checkpoints: {message}")
        self._barrier()
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
            self._barrier()       # every rank has looked before anything goes
            if self.rank == 0:
                for step in doomed:
                    shutil.rmtree(os.path.join(self.ckpt_root, f"step_{step}"))
            self._barrier()
        return path

    def _barrier(self):
        if self.dims.world_size > 1:
            import torch.distributed as dist
            dist.barrier()

    def _micro_batch(self, inputs_BS, targets_BS, stats: StepStats, last: bool = True):
        """One micro-batch of a whole model (pp = 1), sync armed when `last` (for tests)."""
        return self.engine.micro_batch(inputs_BS, targets_BS, stats, last)

    def forward_backward(self, stats: StepStats) -> torch.Tensor:
        """This rank's micro-batches of one step, gradients reduced; returns their loss sum
        (under pp: zero except on the last stage; the step-end reduction sums over pp)."""
        base = self.sampler.position + self.first_micro
        batches = [self.sampler.batch(base + i) for i in range(self.num_local_micro)]
        loss_sum = self.engine.forward_backward([b[0] for b in batches], [b[1] for b in batches],
                                                stats)
        self.sampler.position += self.num_micro
        return loss_sum

    def train_step(self) -> dict:
        """One optimizer step over this rank's micro-batches; returns the global metrics record."""
        tcfg, engine = self.cfg.train, self.engine
        start = time.perf_counter()
        stats = StepStats(len(engine.moe_layer_ids), self.cfg.model.num_experts, self.device)
        loss_sum = self.forward_backward(stats)
        engine.finish_step(stats, loss_sum)
        max_norm = tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf")
        grad_norm = float(engine.clip_grad_norm(max_norm))
        loss = float(loss_sum) / self.num_micro
        self.step += 1
        lr = lr_at(self.step, tcfg)
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped:
            engine.zero_grad()
            message = (f"step {self.step}: non-finite loss={loss} or grad_norm={grad_norm}; "
                       f"{'stopping' if tcfg.on_nonfinite == 'stop' else 'step skipped'}, "
                       "parameters unchanged")
            self.log(message)
            if tcfg.on_nonfinite == "stop":
                raise NonFiniteError(message)
        else:
            engine.optimizer_step(lr, stats)
            engine.zero_grad()
        elapsed = time.perf_counter() - start
        tokens = tcfg.global_batch_size * tcfg.seq_len
        record = {"step": self.step, "loss": loss, **stats.summary(), "grad_norm": grad_norm,
                  "lr": lr, "tokens_per_s": tokens / elapsed, "skipped": skipped}
        self.last_stats = stats
        return record

    def expert_bias_LE(self):
        """Every MoE layer's selection bias [L, E], or None; a collective over pp under pp > 1."""
        router = self.cfg.router
        if router.bias_update_rate == 0 or router.type != "topk" or not self.engine.moe_layer_ids:
            return None
        return self.engine.expert_bias_LE(self.cfg.model.num_experts)

    def save(self, background: bool = False) -> str:
        """Checkpoints this step (a collective). `background`: training resumes once the boxes
        are copied to host memory; `poll_save` commits when every rank has written its files.
        A save first finishes the one still in flight."""
        self.finish_save()
        state = {"step": self.step, "data_position": self.sampler.position,
                 "config": to_dict(self.cfg), "layout": self.dims.describe(),
                 "dataset": self.sampler.fingerprint}
        pending = PendingSave(self.ckpt_root, self.step, self.engine, state,
                              keep=self.cfg.run.keep_checkpoints, background=background)
        if background:
            self.pending_save = pending
            self.log(f"checkpoint step {self.step}: training waited {pending.stall_s:.2f} s "
                     "(copy to host memory); writing in the background")
            return pending.final
        path = pending.finish()
        self.log(f"saved {path} in {pending.stall_s:.2f} s")
        return path

    pending_save = None

    def poll_save(self):
        """Commits a background save once every rank has written its files (one small
        all-reduce per step while a save is in flight; no waiting)."""
        if self.pending_save is None:
            return
        done = torch.tensor([float(self.pending_save.done())], device=self.device)
        if self.dims.world_size > 1:
            import torch.distributed as dist
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if float(done) == 1.0:
            self.finish_save()

    def finish_save(self):
        """Waits for a background save and commits it (a collective)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            self.log(f"saved {pending.finish()} (in the background)")

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
                if self.validation is not None and self.validation.due(self.step):
                    record.update(self.validation.run(self.engine))   # a collective
                    self.log(f"step {self.step:>5} | val_loss {record['val_loss']:.4f} | "
                             f"val_ppl {record['val_ppl']:.2f}")
                records.append(record)
                bias_LE = self.expert_bias_LE()   # every rank; expert_load.jsonl keeps it
                if writer is not None:
                    writer.write(record, self.last_stats, bias_LE)
                if cfg.run.log_every and (self.step % cfg.run.log_every == 0 or self.step == 1
                                          or self.step == cfg.train.steps):
                    self.log(progress_line(record, cfg.train.steps))
                self.poll_save()
                every = cfg.run.checkpoint_every
                if self.step == cfg.train.steps or (every and self.step % every == 0):
                    self.save(background=cfg.run.async_checkpoint)
            self.finish_save()
        finally:
            if writer is not None:
                writer.close()
        return records


def progress_line(r: dict, total_steps: int) -> str:
    return (f"step {r['step']:>5}/{total_steps} | loss {r['loss']:.4f} | aux {r['aux_loss']:.4f} | "
            f"z {r['z_loss']:.2e} | gnorm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s'] / 1000:.1f}k tok/s | load max/mean {r['max_load_ratio']:.2f} | "
            f"drop {100 * r['drop_fraction']:.1f}%")
