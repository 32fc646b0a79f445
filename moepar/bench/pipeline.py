"""`moepar bench pipeline`: a schedule's measured bubble and activation memory per stage.

Runs a real Trainer on --pp local processes (gloo, one thread each) for a few steps and reports,
per pipeline rank:
- the bubble: 1 - (time inside this rank's forward/backward actions) / (the step's wall time),
  median over the timed steps, beside the formula (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved;
- peak activation memory: the most bytes of tensors autograd saved for backward that were alive
  at once during a step (counted per storage through saved-tensor hooks; parameters excluded),
  with the most micro-batches in flight that the schedule allowed.
"""

import contextlib
import statistics
import sys
import tempfile
import weakref

import torch
import torch.distributed as dist

from moepar.bench.ticker import Ticker
from moepar.config import load_config
from moepar.parallel.schedules import ideal_bubble, measured_bubble
from moepar.process import end_process_group
from moepar.train import Trainer

__all__ = ["worker_main", "print_result", "SavedActivationMeter"]


class SavedActivationMeter:
    """Counts bytes of autograd-saved tensors alive at once (by storage), excluding `exclude`."""

    def __init__(self, exclude):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs: dict[int, int] = {}
        self.alive = self.peak = 0

    class _Box:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor):
            self.tensor = tensor

    def _release(self, ptr: int, nbytes: int):
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.alive -= nbytes

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.skip or storage.nbytes() == 0:
            return t
        if ptr not in self.refs:
            self.refs[ptr] = 0
            self.alive += storage.nbytes()
            self.peak = max(self.peak, self.alive)
        self.refs[ptr] += 1
        box = self._Box(t)
        weakref.finalize(box, self._release, ptr, storage.nbytes())
        return box

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, SavedActivationMeter._Box) else packed

    @contextlib.contextmanager
    def active(self):
        self.peak = self.alive
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def worker_main(args) -> dict:
    """Runs on every rank; returns every pipeline rank's figures (rank 0 prints)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            virtual = args.virtual if args.schedule == "interleaved_1f1b" else 1
            overrides = [f"--model.dim={args.dim}", f"--model.num_layers={args.layers}",
                         f"--model.num_heads={args.heads}", f"--model.num_kv_heads={args.heads}",
                         f"--model.ffn_dim={2 * args.dim}", f"--model.moe_ffn_dim={args.dim}",
                         f"--model.num_experts={args.experts}", f"--model.max_seq_len={args.seq}",
                         f"--train.seq_len={args.seq}", f"--train.micro_batch_size={args.micro_batch}",
                         f"--train.global_batch_size={args.micro_batch * args.microbatches}",
                         f"--parallel.pp={args.pp}", f"--parallel.pp_schedule={args.schedule}",
                         f"--parallel.pp_virtual={virtual}", "--run.tensorboard=false",
                         # CPU processes: action timings need no device synchronisation.
                         "--train.device=cpu",
                         "--run.log_every=0", f"--run.dir={tmp}"]
            trainer = Trainer(load_config(None, overrides), log=lambda _m: None,
                              shared_run_dir=False)   # a scratch dir per rank, no saves
            runner = trainer.runner
            meter = SavedActivationMeter(list(trainer.model.parameters()))
            bubbles, peaks, walls = [], [], []
            tick = Ticker("pipeline", args.warmup, args.repeats)
            for step in range(args.warmup + args.repeats):
                with meter.active():
                    trainer.train_step()
                if step >= args.warmup:
                    bubbles.append(measured_bubble(runner.events, runner.step_start, runner.step_end))
                    walls.append(runner.step_end - runner.step_start)
                    peaks.append(meter.peak)
                tick(step + 1)
            mine = {"pp_rank": trainer.dims.coords(trainer.rank).pp,
                    "layers": trainer.model.layer_ids,
                    "bubble": statistics.median(bubbles), "step_ms": 1000 * statistics.median(walls),
                    "peak_activation_bytes": max(peaks), "peak_in_flight": runner.peak_in_flight}
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        return {"pp": args.pp, "schedule": args.schedule, "virtual": virtual,
                "microbatches": args.microbatches, "repeats": args.repeats,
                "ideal_bubble": ideal_bubble(args.pp, args.microbatches, virtual),
                "ranks": ranks}
    finally:
        end_process_group(clean=sys.exc_info()[0] is None)


def print_result(result: dict):
    print(f"pipeline: pp={result['pp']} schedule={result['schedule']} virtual={result['virtual']} "
          f"micro-batches={result['microbatches']}; median of {result['repeats']} steps; "
          f"formula bubble {result['ideal_bubble']:.3f}")
    print(f"  {'rank':>4} {'layers':<12} {'bubble':>7} {'step ms':>8} {'in flight':>9} "
          f"{'peak activations':>17}")
    for r in result["ranks"]:
        layers = ",".join(map(str, r["layers"]))
        print(f"  {r['pp_rank']:>4} {layers:<12} {r['bubble']:>7.3f} {r['step_ms']:>8.1f} "
              f"{r['peak_in_flight']:>9} {r['peak_activation_bytes'] / 2**20:>14.1f} MiB")
