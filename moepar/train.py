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

When a run must stop, every rank stops at the same step, because each decision rests on numbers
all ranks share: the global loss and grad norm, and one small all-reduce per step (MAX) of two
flags, "parameters went non-finite in the last updates" (checked at step 1 and every
run.log_every steps, see `_check_params_due`) and "SIGTERM arrived". Those ride the one
host sync a step already makes (loss and grad norm), so the checks cost no extra sync:
- more than train.max_skipped_steps skipped steps in a row, or non-finite parameters after an
  update: NonFiniteError (exit 3), nothing saved after the damage;
- SIGTERM (preemption by SLURM or Kubernetes): the step finishes, a checkpoint is saved, and
  `Preempted` is raised (exit 75).
"""

import math
import os
import signal
import threading
import time

import torch

from moepar.build import build_dims, build_engine
from moepar.checkpoint import PendingSave, latest_checkpoint, load_checkpoint
from moepar.cluster import check_shared_filesystem
from moepar.config import RunConfig, to_dict
from moepar.data.sources import build_sampler
from moepar.expert_placement import Replacer, describe as describe_placement
from moepar.layers.shapes import param_count
from moepar.loss_scale import LossScaler
from moepar.metrics import MetricsWriter, PendingMetrics, StepStats
from moepar.process import init_process_group, select_device
from moepar.progress import Progress, params_text
from moepar.rundir import (DivergenceReplay, RunDirError, RunLock, launcher_holds_lock,
                           plan_run_start, record_divergence, write_config)
from moepar.validation import Validation

__all__ = ["Trainer", "lr_at", "NonFiniteError", "ReplayRefused", "Preempted"]

class NonFiniteError(RuntimeError):
    """The run diverged: a NaN or Inf loss or grad norm (with train.on_nonfinite='stop', or more
    than train.max_skipped_steps steps in a row), or non-finite parameters after an update.
    Raised on every rank at the same step."""


class ReplayRefused(NonFiniteError):
    """The start would replay a divergence recorded in run.dir (rundir.refuse_replay): the run is
    still diverged (exit 3), nothing was changed. Raised on every rank before training."""


class Preempted(Exception):
    """SIGTERM arrived: every rank finished the same step, and it was saved at `path`."""

    def __init__(self, step: int, path: str):
        super().__init__(f"stopped on SIGTERM after step {step}; saved {path}; continue with "
                         "--run.resume=true")
        self.step, self.path = step, path


def lr_at(step: int, cfg) -> float:
    """Learning rate for 1-based `step`: linear warmup to train.lr, then cosine to lr*min_lr_ratio."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Builds the data, the layout and the parallel model from a validated RunConfig; `run()` trains."""

    def __init__(self, cfg: RunConfig, log=print, config_path: str | None = None,
                 shared_run_dir: bool = True):
        """`shared_run_dir=False`: each rank has a scratch run.dir of its own and nothing is
        saved (benchmarks); skips the check that run.dir is one filesystem for all ranks."""
        self.cfg, self.config_path = cfg, config_path
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
        if shared_run_dir:   # every rank writes checkpoints there (a no-op alone)
            try:
                check_shared_filesystem(cfg.run.dir, self.rank, world_size)
            except ValueError as e:
                raise RunDirError(str(e)) from None
        self.layout = self.dims.bind(self.rank, self.device)
        coords = self.layout.coords
        self.num_micro = tcfg.global_batch_size // tcfg.micro_batch_size
        self.num_local_micro = self.num_micro // self.dims.dp
        self.first_micro = coords.dp * self.num_local_micro
        self.ckpt_root = os.path.join(cfg.run.dir, "checkpoints")
        self.discarding = []      # background deletions (pruned checkpoints), joined by run()
        self.run_lock = self._lock_run_dir()
        # Another dataset or a changed run is refused there, before run.dir changes.
        resume_path = self._resume_path()
        self.engine = build_engine(cfg, self.layout, self.device, self.num_local_micro)
        # float16 needs loss scaling (dynamic); elsewhere train.loss_scale > 0 is a fixed scale.
        self.scaler = None
        if tcfg.dtype == "float16" or tcfg.loss_scale > 0:
            self.scaler = LossScaler(tcfg.loss_scale or 2.0 ** 16, dynamic=tcfg.dtype == "float16")
        self.step = 0
        self.skipped_in_row = 0           # consecutive skipped steps (train.max_skipped_steps)
        self.stop_requested = False       # set by SIGTERM; acted on at a step end, by all ranks
        self._params_check = None         # device norm of the parameters after the last update
        self._params_unchecked_from = None   # the first update since the parameters were checked
        self.saved_step = None
        if resume_path:
            state = load_checkpoint(resume_path, self.engine, optimizer=True, log=self.log)
            self.step, self.sampler.position = state["step"], state.get("data_position", 0)
            self.saved_step = self.step
            if self.scaler is not None and "loss_scale" in state:
                self.scaler.load_state_dict(state["loss_scale"])
            self.log(f"resumed from {resume_path} at step {self.step}")
        elif cfg.run.init_from:
            load_checkpoint(cfg.run.init_from, self.engine, restore_rng=False)
            self.log(f"initialised weights from {cfg.run.init_from}")
        if self.dims.gpus_per_node:
            self.log(f"nodes: {self.dims.describe_nodes()}")
        placement = self.rank == 0 and describe_placement(cfg, self.dims.ep,
                                                          self.dims.gpus_per_node)
        if placement:
            self.log(placement)
        self.replacer = (Replacer(cfg, self.engine, self.dims.ep, self.dims.gpus_per_node)
                         if cfg.parallel.replace_every and self.dims.ep > 1 else None)
        self.log(f"layout: {self.dims.describe()}; zero {cfg.parallel.zero}; "
                 f"{self.num_local_micro} micro-batch(es) of "
                 f"{tcfg.micro_batch_size} per rank per step; device {self.device}")
        self.log(params_text(param_count(cfg.model)))

    # The handle's parts, by the names tests and benchmarks use.
    model = property(lambda self: self.engine.model)
    optimizer = property(lambda self: self.engine.optimizer)
    sync = property(lambda self: self.engine.sync)
    runner = property(lambda self: self.engine.runner)
    meshes = property(lambda self: self.layout.meshes)

    def _lock_run_dir(self) -> RunLock | None:
        """Rank 0 holds run.dir's lock for the run's life, unless the `moepar train --nproc`
        launcher that started this worker holds it; all ranks refuse together when it is taken."""
        lock, error = None, None
        if self.rank == 0 and not launcher_holds_lock():
            try:
                lock = RunLock(self.cfg.run.dir)
                if not lock.supported:
                    self.log(f"warning: run.dir={self.cfg.run.dir!r} does not support file "
                             f"locks ({lock.error}): nothing stops a second run from using it")
            except RunDirError as e:
                error = str(e)
        error = self.layout.from_rank0(error)
        if error:
            raise RunDirError(error)
        return lock

    def release(self):
        """Lets go of run.dir (the end of the run); also when the object is dropped."""
        if self.run_lock is not None:
            self.run_lock.release()

    def __del__(self):
        if getattr(self, "run_lock", None) is not None:
            self.run_lock.release()

    def _resume_path(self) -> str | None:
        """The checkpoint to resume from, or None for a fresh start; refuses what would lose or
        mix up a previous run's files, another dataset or a changed run. Rank 0 decides, under
        the lock, and changes run.dir (crash recovery, an asked overwrite) only once every check
        has passed; all ranks agree. Rank 0's file work here is renames only (deletions go to a
        background thread), so the others never wait long in the broadcast."""
        error, kind, path = None, None, None
        if self.rank == 0:
            try:
                plan = plan_run_start(self.cfg, self.ckpt_root, self.config_path,
                                      self.sampler.fingerprint)
                for note in plan.notes:
                    self.log(f"resume: {note}")
                path, threads = plan.apply(self.log)
                self.discarding += threads
            except (ValueError, OSError) as e:     # RunDirError, CheckpointError, ...
                error = str(e)
                kind = ("replay" if isinstance(e, DivergenceReplay) else
                        "refused" if isinstance(e, RunDirError) else "failed")
        error, kind, path = self.layout.from_rank0((error, kind, path))
        if error:
            raise {"replay": ReplayRefused, "refused": RunDirError}.get(kind, ValueError)(error)
        return path

    def _micro_batch(self, inputs_BS, targets_BS, stats: StepStats, last: bool = True):
        """One micro-batch of a whole model (pp = 1), sync armed when `last` (for tests)."""
        return self.engine.micro_batch(inputs_BS, targets_BS, stats, last)

    def forward_backward(self, stats: StepStats) -> torch.Tensor:
        """This rank's micro-batches of one step, gradients reduced; returns their loss sum
        (under pp: zero except on the last stage; the step-end reduction sums over pp)."""
        base = self.sampler.position + self.first_micro
        batches = [self.sampler.batch(base + i) for i in range(self.num_local_micro)]
        packed = {}
        if getattr(self.sampler, "packed", False):   # data.pack: documents, weighted losses
            packed = {"documents": [b[2] for b in batches], "weights": self._loss_weights()}
        loss_sum = self.engine.forward_backward([b[0] for b in batches], [b[1] for b in batches],
                                                stats, **packed)
        self.sampler.position += self.num_micro
        return loss_sum

    def _loss_weights(self) -> list[float]:
        """Packed documents: each local micro-batch's mean loss times (its counted targets) x
        (micro-batches per step) / (counted targets of the global batch), so that the step's
        loss, once averaged over micro-batches and dp ranks as always, is the mean over every
        counted token of the global batch, not a mean of means. Counts come from the document
        ends alone (every rank computes the same ones, no collective)."""
        position = self.sampler.position
        counts = [self.sampler.counted(position + i) for i in range(self.num_micro)]
        total = max(sum(counts), 1)
        return [counts[self.first_micro + i] * self.num_micro / total
                for i in range(self.num_local_micro)]

    def train_step(self) -> dict:
        """One optimizer step over this rank's micro-batches; returns the global metrics record.
        Raises NonFiniteError (every rank) when the run has diverged; sets `stop_agreed` when
        any rank asked to stop (SIGTERM)."""
        tcfg, engine = self.cfg.train, self.engine
        start = time.perf_counter()
        stats = StepStats(len(engine.moe_layer_ids), self.cfg.model.num_experts, self.device)
        if self.scaler is not None:
            engine.set_loss_scale(self.scaler.scale)
        loss_sum = self.forward_backward(stats)
        engine.finish_step(stats, loss_sum)
        grad_norm_t = engine.grad_norm()
        flags = self._step_flags()
        # The step's one host sync: loss, grad norm and the two agreed flags together; clipping
        # follows it, so a step within the limit multiplies no gradient.
        loss_sum_v, grad_norm, params_bad, stop, mtp_sum = torch.cat(
            [loss_sum.reshape(1).double(), grad_norm_t.reshape(1).double(), flags,
             stats.mtp_1]).tolist()
        first = self._params_unchecked_from
        if self._params_check is not None:       # the updates so far were checked just now
            self._params_check = self._params_unchecked_from = None
        if params_bad:
            engine.zero_grad()
            what = (f"the update of step {self.step}" if first == self.step else
                    f"an update of steps {first}-{self.step} (parameters are checked every "
                    f"run.log_every={self.cfg.run.log_every} steps)")
            raise NonFiniteError(self._diverged(f"{what} made parameters non-finite (NaN or Inf)"))
        self.stop_agreed = bool(stop)
        loss = loss_sum_v / self.num_micro
        self.step += 1
        lr = lr_at(self.step, tcfg)
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        # float16: an infinite norm with a finite loss is the scale overflowing, not divergence:
        # the step is skipped and the scale backs off (the same decision on every rank).
        overflow = (skipped and math.isfinite(loss) and self.scaler is not None
                    and self.scaler.dynamic)
        if self.scaler is not None:
            note = self.scaler.update(not skipped)
            if note:
                self.log(f"step {self.step}: {note}")
        if overflow:
            engine.zero_grad()
        elif skipped:
            engine.zero_grad()
            self.skipped_in_row += 1
            what = f"step {self.step}: non-finite loss={loss} or grad_norm={grad_norm}"
            if tcfg.on_nonfinite == "stop":
                raise NonFiniteError(self._diverged(f"{what} (train.on_nonfinite='stop')"))
            if self.skipped_in_row > tcfg.max_skipped_steps:
                raise NonFiniteError(self._diverged(
                    f"{what}: {self.skipped_in_row} skipped steps in a row, more than "
                    f"train.max_skipped_steps={tcfg.max_skipped_steps}"))
            self.log(f"{what}; step skipped, parameters unchanged ({self.skipped_in_row} in a "
                     f"row; the run stops after {tcfg.max_skipped_steps})")
        else:
            self.skipped_in_row = 0
            engine.clip_gradients(grad_norm, tcfg.grad_clip if tcfg.grad_clip > 0 else math.inf)
            engine.optimizer_step(lr, stats)
            engine.zero_grad()
            if self._params_unchecked_from is None:
                self._params_unchecked_from = self.step
        if self._params_unchecked_from is not None and self._check_params_due():
            self._params_check = engine.parameters_norm()     # read at the next step's sync
        elapsed = time.perf_counter() - start
        tokens = tcfg.global_batch_size * tcfg.seq_len
        # The router statistics join the record when the run loop reads them, in a batch
        # (metrics.PendingMetrics); `stats.summary()` reads them now.
        record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                  "tokens_per_s": tokens / elapsed, "skipped": skipped}
        if self.cfg.model.mtp_layers:   # "loss" is the main model's; the trained one adds this
            record["mtp_loss"] = mtp_sum / self.num_micro
        self.last_stats = stats
        return record

    def _check_params_due(self) -> bool:
        """Whether this update's parameters are checked for NaN/Inf (a full read of them) at the
        next step's sync: at step 1, every run.log_every steps (every step when 0), and every
        step with train.eps = 0 (where 0/0 makes NaN out of finite numbers). Between checks a
        finite update of finite parameters by finite gradients, lr and moments stays finite
        but for overflow (|update| <= lr/eps per element); what slips through is caught at the
        next check, and before every save (check_parameters), so it is never saved."""
        every = self.cfg.run.log_every or 1
        return self.cfg.train.eps == 0 or self.step == 1 or self.step % every == 0

    stop_agreed = False

    def _step_flags(self, params_norm=None) -> torch.Tensor:
        """[parameters non-finite after the last update, SIGTERM seen], 0 or 1 each, the MAX over
        every rank (one small all-reduce; read by the caller's host sync)."""
        params_norm = self._params_check if params_norm is None else params_norm
        flags = torch.zeros(2, dtype=torch.float64, device=self.device)
        if params_norm is not None:
            flags[0] = (~torch.isfinite(params_norm)).double()
        if self.stop_requested:
            flags[1] = 1.0
        return self.layout.all_reduce(flags, "max")

    def _diverged(self, what: str) -> str:
        saved = latest_checkpoint(self.ckpt_root)
        advice = ("lower train.lr, raise train.eps or tighten train.grad_clip, then "
                  + ("--run.resume=true --run.allow_changes=<the keys you changed>" if saved
                     else "start again with --run.overwrite=true"))
        return (f"the run diverged: {what}. No checkpoint holds non-finite values; the newest "
                f"is {saved or 'none'}. To go on: {advice}")

    def check_parameters(self):
        """Raises NonFiniteError on every rank if any rank's parameters are non-finite now (a
        collective and a host sync: before saves, not per step)."""
        bad, _ = self._step_flags(self.engine.parameters_norm()).tolist()
        if bad:
            raise NonFiniteError(self._diverged(f"parameters are non-finite at step {self.step}"))
        self._params_unchecked_from = None

    def expert_bias_LE(self):
        """Every MoE layer's selection bias [L, E], or None; a collective over pp under pp > 1."""
        router = self.cfg.router
        if router.bias_update_rate == 0 or router.type != "topk" or not self.engine.moe_layer_ids:
            return None
        return self.engine.expert_bias_LE(self.cfg.model.num_experts)

    def save(self, background: bool = False, reason: str = "") -> str:
        """Checkpoints this step (a collective). `background`: training resumes once the boxes
        are copied to host memory; `poll_save` commits when every rank has written its files.
        A save first finishes the one still in flight, and checks on every rank that the
        parameters are finite (NonFiniteError otherwise: a diverged model is never saved)."""
        self.finish_save()
        self.check_parameters()
        state = {"step": self.step, "data_position": self.sampler.position,
                 "config": to_dict(self.cfg), "layout": self.dims.describe(),
                 "dataset": self.sampler.fingerprint}
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        if reason:
            state["stop_reason"] = reason
        self.log(f"saving step {self.step} to {self.ckpt_root} ...")   # a large save takes a while
        pending = PendingSave(self.ckpt_root, self.step, self.engine, state,
                              keep=self.cfg.run.keep_checkpoints, background=background)
        self.saved_step = self.step
        if background:
            self.pending_save = pending
            self.log(f"checkpoint step {self.step}: training waited {pending.stall_s:.2f} s "
                     "(copy to host memory); writing in the background")
            return pending.final
        path = pending.finish()
        self.discarding += pending.discarding
        self.log(f"saved {path} in {pending.stall_s:.2f} s")
        return path

    pending_save = None

    def poll_save(self):
        """Commits a background save once every rank has written its files (one small
        all-reduce per step while a save is in flight; no waiting)."""
        if self.pending_save is None:
            return
        done = torch.tensor([float(self.pending_save.done())], device=self.device)
        self.layout.all_reduce(done, "min")
        if float(done) == 1.0:
            self.finish_save()

    def finish_save(self):
        """Waits for a background save and commits it (a collective)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            self.log(f"saved {pending.finish()} (in the background)")
            self.discarding += pending.discarding

    def run(self) -> list[dict]:
        """Trains to train.steps, logging and checkpointing; returns this call's records.
        Raises NonFiniteError when the run diverges, Preempted after a SIGTERM (saved)."""
        cfg = self.cfg
        writer = None
        records = []
        pending = PendingMetrics()     # steps whose router statistics are not yet read
        try:
            with _StopOnSignal(self):
                if self.rank == 0:
                    os.makedirs(cfg.run.dir, exist_ok=True)
                    if not write_config(cfg, self.config_path):
                        self.log(f"{cfg.run.dir}/config.toml is the input config: left as it is "
                                 "(the resolved config is in each checkpoint's state.json)")
                    writer = MetricsWriter(cfg.run.dir, cfg.run.tensorboard,
                                           resume_step=self.step, ep=self.dims.ep,
                                           model=cfg.model, image_every=cfg.run.tb_image_every)
                progress = Progress(cfg.train.steps, cfg.train.global_batch_size *
                                    cfg.train.seq_len, self.step, time.perf_counter())
                while self.step < cfg.train.steps:
                    record = self.train_step()
                    if not records and self.engine.compiled is not None:   # compiled just now
                        self.log(self.engine.compiled.summary())
                    if self.validation is not None and self.validation.due(self.step):
                        record.update(self.validation.run(self.engine))   # a collective
                        self.log(f"step {self.step:>5} | val_loss {record['val_loss']:.4f} | "
                                 f"val_ppl {record['val_ppl']:.2f}")
                    records.append(record)
                    bias_LE = self.expert_bias_LE()   # every rank; expert_load.jsonl keeps it
                    pending.add(record, self.last_stats, bias_LE)
                    if self.replacer is not None:     # every rank, between steps
                        moved = self.replacer.after_step(self.step, self.last_stats.tokens_LE)
                        if moved:
                            self.log(moved)
                    every = cfg.run.checkpoint_every
                    log_due = self.step % (cfg.run.log_every or 1) == 0 or self.step == 1 or \
                        self.step == cfg.train.steps
                    if log_due or (every and self.step % every == 0) or self.stop_agreed:
                        self._write_metrics(pending, writer)   # before any save: on disk too
                    if cfg.run.log_every and log_due:
                        self.log(progress.line(record, time.perf_counter()))
                    self.poll_save()
                    if self.step == cfg.train.steps or (every and self.step % every == 0):
                        self.save(background=cfg.run.async_checkpoint and not self.stop_agreed,
                                  reason="preempted" if self.stop_agreed else "")
                    if self.stop_agreed and self.step < cfg.train.steps:
                        self.log(f"SIGTERM: stopping after step {self.step}")
                        self.finish_save()
                        path = (os.path.join(self.ckpt_root, f"step_{self.step}")
                                if self.saved_step == self.step else
                                self.save(reason="preempted"))
                        raise Preempted(self.step, path)
                self.finish_save()
        except NonFiniteError as e:
            # So that a restart does not replay it (rundir.refuse_replay); a SIGTERM now (the
            # elastic agent stopping this worker once another has exited) waits for the record.
            if self.rank == 0:
                with _StopOnSignal(self):
                    try:
                        record_divergence(cfg.run.dir, self.step, str(e), to_dict(cfg))
                    except OSError as err:     # the divergence is the news, not the record
                        self.log(f"warning: could not record the divergence in {cfg.run.dir}: "
                                 f"{err}")
            raise
        finally:
            try:
                self._write_metrics(pending, writer)    # what a stop or an error left pending
            finally:
                if writer is not None:
                    writer.close()
            for thread in self.discarding:    # a finished run leaves no half-deleted folder
                thread.join()
            self.release()
        return records


    @staticmethod
    def _write_metrics(pending: PendingMetrics, writer: MetricsWriter | None):
        """The pending steps' statistics read (one host sync, every rank: the records returned
        are complete everywhere) and written (rank 0)."""
        steps = pending.flush()
        if writer is not None:
            writer.write_many(steps)


class _StopOnSignal:
    """While training, SIGTERM (what SLURM and Kubernetes send on preemption) only sets
    `trainer.stop_requested`: the step in progress finishes, every rank agrees at its end, and
    the run saves and stops. Repeats are ignored (a launcher forwards the signal that a
    scheduler may also have sent each worker directly); SIGKILL after the grace period remains
    the scheduler's. Installed only in the main thread (Python's rule for signal handlers)."""

    def __init__(self, trainer):
        self.trainer, self.previous = trainer, None

    def _handle(self, signum, frame):
        self.trainer.stop_requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        return False
