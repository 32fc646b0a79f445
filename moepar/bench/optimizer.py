"""`moepar bench optimizer`: the cost of Muon against AdamW, per training step of a config in one
process: the optimizer step alone (Newton-Schulz on every matrix against AdamW's elementwise
update) and the whole step, the two optimizers alternating so both see the same machine."""

import copy
import statistics
import tempfile
import time

from moepar.bench.ticker import Ticker
from moepar.bench.train import alternate, sync_device
from moepar.train import Trainer

__all__ = ["bench_optimizer", "print_result", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "muon")


def _trainer(cfg, optimizer: str, steps: int, tmp: str) -> Trainer:
    cfg = copy.deepcopy(cfg)
    cfg.run.dir, cfg.run.tensorboard = f"{tmp}/{optimizer}", False
    cfg.run.checkpoint_every = 0
    cfg.train.optimizer, cfg.train.steps = optimizer, steps
    trainer = Trainer(cfg, log=lambda _m: None, shared_run_dir=False)
    optim, device, spent = trainer.engine.optimizer, trainer.device, []
    inner = optim.step

    def timed_step(*args, **kwargs):    # the optimizer step inside the real training step
        sync_device(device)
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        sync_device(device)
        spent.append(time.perf_counter() - start)
        return out
    optim.step = timed_step
    trainer.optimizer_seconds = spent
    return trainer


def bench_optimizer(cfg, steps: int = 5, warmup: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: _trainer(cfg, name, warmup + steps, tmp) for name in OPTIMIZERS}
        device = trainers["adamw"].device
        runs = {name: trainer.train_step for name, trainer in trainers.items()}
        step_s = alternate(runs, device, warmup, steps, Ticker("optimizer", warmup, steps))
        out = {"device": str(device), "dtype": cfg.train.dtype, "steps": steps}
        for name, trainer in trainers.items():
            out[f"{name}_step_ms"] = 1000 * statistics.median(step_s[name])
            out[f"{name}_optimizer_ms"] = 1000 * statistics.median(
                trainer.optimizer_seconds[warmup:])
    out["muon_over_adamw_step"] = out["muon_step_ms"] / out["adamw_step_ms"]
    return out


def print_result(r: dict):
    print(f"optimizer: {r['device']} {r['dtype']}, median of {r['steps']} steps each, alternating: "
          f"AdamW step {r['adamw_optimizer_ms']:.1f} ms of {r['adamw_step_ms']:.1f} ms; Muon "
          f"step {r['muon_optimizer_ms']:.1f} ms of {r['muon_step_ms']:.1f} ms (training step "
          f"x{r['muon_over_adamw_step']:.3f})")
