"""`moepar bench checkpoint`: build, save and load a model of a chosen total size on N local
processes; per rank, the seconds and the peak resident memory of each phase against what the
rank holds.

Each rank reports its shard bytes (its parameters, buffers and AdamW state), the largest
single canonical dense tensor, and for each phase the growth of its peak resident set size
(VmHWM, reset through /proc/self/clear_refs before the phase) over the resident size when the
phase began:
- build: the model on the meta device, this rank's shards allocated and drawn;
- save: one checkpoint of the parameters and AdamW state (after one step);
- load: a fresh trainer resuming from it (a build, then the reads).
A rank that gathered whole tensors would grow by the whole EP-local model, or more.
Memory the allocator keeps after a free would hide later growth, so allocations of 64 KiB and
more are mapped and unmapped directly while this runs (glibc mallopt).
"""

import ctypes
import dataclasses
import gc
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from moepar.bench.ticker import Ticker
from moepar.config import load_config
from moepar.layers import Transformer
from moepar.process import end_process_group
from moepar.train import Trainer

__all__ = ["worker_main", "print_result", "model_overrides"]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class _Peak:
    """Peak resident growth of a phase (Linux: VmHWM reset by writing 5 to clear_refs)."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start, self.t0 = _status("VmRSS"), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.growth = _status("VmHWM") - self.start


def model_overrides(size_gb: float, ep: int) -> list[str]:
    """A model of about size_gb GB (float32) whose bulk is experts: dim 512, 32 experts of
    hidden 1024, as many layers as the size needs (at least 2)."""
    per_layer = 32 * 512 * 1024 * 3 * 4 + 4 * 512 * 512 * 4
    layers = max(2, round(size_gb * 1e9 / per_layer))
    return [f"--model.dim=512", f"--model.num_layers={layers}", "--model.num_heads=8",
            "--model.num_kv_heads=8", "--model.ffn_dim=1024", "--model.moe_ffn_dim=1024",
            "--model.num_experts=32", "--model.top_k=2", "--model.vocab_size=256",
            "--model.max_seq_len=16", "--train.seq_len=16", "--train.micro_batch_size=1",
            f"--parallel.ep={ep}"]


def _warm_up(cfg):
    """Runs the code paths a build uses once on a tiny model, so their one-time imports (torch's
    meta-device registrations alone cost ~75 MB of resident code) are not counted as data."""

    tiny = dataclasses.replace(cfg.model, num_layers=1, dim=8, num_heads=1, num_kv_heads=1,
                               ffn_dim=8, moe_ffn_dim=8, num_experts=2, top_k=1)
    with torch.device("meta"):
        Transformer(tiny, cfg.router, seed=0)
    Transformer(tiny, cfg.router, seed=0)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker_main(args) -> dict:
    libc = ctypes.CDLL("libc.so.6")
    M_MMAP_THRESHOLD, M_MMAP_MAX = -3, -4      # undo the CLI's allocator tuning here
    libc.mallopt(M_MMAP_MAX, 1 << 20)
    libc.mallopt(M_MMAP_THRESHOLD, 64 << 10)
    world = int(os.environ.get("WORLD_SIZE", 1))
    tmp = None
    try:
        if not dist.is_initialized() and world > 1:
            dist.init_process_group("gloo")
        tmp = tempfile.mkdtemp(prefix="moepar-bench-checkpoint-", dir=args.dir)
        if world > 1:      # every rank writes into rank 0's directory
            box = [tmp]
            dist.broadcast_object_list(box, src=0)
            if box[0] != tmp:
                os.rmdir(tmp)
            tmp = box[0]
        if True:
            overrides = model_overrides(args.size_gb, args.ep or world) + [
                f"--train.global_batch_size={world}", f"--parallel.zero={args.zero}",
                "--train.steps=1", "--run.tensorboard=false", "--run.log_every=0",
                "--run.checkpoint_every=0", f"--run.dir={tmp}"]
            cfg = load_config(None, overrides)
            say = Ticker("checkpoint", 0, 0).say
            say(f"building a {args.size_gb:g} GB model")
            _warm_up(cfg)
            with _Peak() as build:
                trainer = Trainer(cfg, log=lambda _m: None)
            engine = trainer.engine
            shards = engine.model_shards()
            shard_bytes = _tensor_bytes(lt.tensor for lt in shards)
            dense = max(math.prod(t.shape) * 4 for n, t in engine.canonical.items()
                        if ".experts." not in n)
            trainer.train_step()
            moments, _ = engine.optimizer_shards()
            optimizer_bytes = _tensor_bytes(lt.tensor for lt in moments)
            largest_box = max(seg.canon.numel * lt.tensor.element_size()
                              for lt in shards + moments for seg in lt.segments)
            engine.zero_grad()
            gc.collect()
            say("saving")
            with _Peak() as save:
                path = trainer.save()
            # The same save in the background: training waits only for the copy to host memory.
            trainer.step += 1
            say("saving in the background")
            start = time.perf_counter()
            trainer.save(background=True)
            async_stall = time.perf_counter() - start
            trainer.finish_save()
            async_total = time.perf_counter() - start
            trainer.step -= 1
            del trainer, engine, shards, moments
            gc.collect()
            resume = load_config(None, overrides + [f"--run.resume_from={path}",
                                                    "--run.overwrite=true"])
            say("loading")
            with _Peak() as load:
                trainer = Trainer(resume, log=lambda _m: None)
            full = sum(math.prod(t.shape) * 4 for t in trainer.engine.canonical.values())
            mine = {"rank": trainer.rank, "shard_bytes": shard_bytes,
                    "optimizer_bytes": optimizer_bytes, "largest_dense_bytes": dense,
                    "largest_box_bytes": largest_box,
                    "build_s": build.seconds, "build_peak_bytes": build.growth,
                    "save_s": save.seconds, "save_peak_bytes": save.growth,
                    "async_stall_s": async_stall, "async_total_s": async_total,
                    "load_s": load.seconds, "load_peak_bytes": load.growth}
            ranks = [mine]
            if dist.is_initialized():
                ranks = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, mine)
        return {"world": world, "ep": args.ep or world, "zero": args.zero,
                "model_bytes": full, "ranks": ranks}
    finally:
        end_process_group(clean=sys.exc_info()[0] is None)   # every rank is done writing
        if tmp is not None and int(os.environ.get("RANK", 0)) == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def print_result(result: dict):
    mb = 1e6
    print(f"checkpoint: model {result['model_bytes'] / mb:,.0f} MB on {result['world']} ranks "
          f"(ep {result['ep']}, zero {result['zero']}); peak resident growth per phase")
    print(f"  {'rank':>4} {'shard MB':>9} {'adam MB':>8} {'build s':>8} {'build MB':>9} "
          f"{'save s':>7} {'save MB':>8} {'async stall s':>13} {'load s':>7} {'load MB':>8}")
    for r in result["ranks"]:
        print(f"  {r['rank']:>4} {r['shard_bytes'] / mb:>9.1f} {r['optimizer_bytes'] / mb:>8.1f} "
              f"{r['build_s']:>8.2f} {r['build_peak_bytes'] / mb:>9.1f} {r['save_s']:>7.2f} "
              f"{r['save_peak_bytes'] / mb:>8.1f} {r['async_stall_s']:>13.2f} "
              f"{r['load_s']:>7.2f} {r['load_peak_bytes'] / mb:>8.1f}")
