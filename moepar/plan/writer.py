"""`moepar plan --write plan.toml`: the best layout the trainer can run, as a complete run config
that `moepar train plan.toml` (on the planned number of processes) runs as is."""

import dataclasses

from moepar.config import TrainConfig, load_config, to_toml

from .candidates import TRAINER_RECOMPUTE, run_config

__all__ = ["runnable", "best_runnable", "plan_config", "write_plan"]


def runnable(layout) -> bool:
    """True if the trainer has the plan's recompute mode (train.recompute)."""
    return layout.recompute in TRAINER_RECOMPUTE


def best_runnable(plans: list):
    return next((p for p in plans if p.fits and runnable(p.layout)), None)


def plan_config(base, plan, req):
    """The run config of `plan` (the base config with the planned layout and batch)."""
    return run_config(base, plan.layout, req)


def write_plan(path: str, base, plan, req, source: str) -> str:
    """Writes the plan's run config as TOML, headed by the estimates, and checks that the
    trainer's loader reads it back to the same config; returns the path."""
    cfg = plan_config(base, plan, req)
    lo = plan.layout
    nodes = max(req.world // req.gpus_per_node, 1)
    header = [
        f"# Written by `moepar plan` for {req.world} x {req.gpu.name} ({req.gpus_per_node} per "
        f"node) from {source}.",
        f"# Layout: {lo.describe()}, {lo.schedule}, micro-batch {lo.micro_batch}, recompute "
        f"{lo.recompute}; estimated {plan.memory['total'] / 2 ** 30:.1f} GiB per GPU, "
        f"{plan.time['step']:.2f} s per step, MFU {100 * plan.mfu:.1f}%.",
        f"#   moepar train {path} --nproc {req.world}" if nodes == 1 else
        f"#   torchrun --nnodes {nodes} --nproc-per-node {req.gpus_per_node} ... -m moepar train "
        f"{path}",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(header) + to_toml(cfg))
    if load_config(path) != cfg:
        raise ValueError(f"{path}: the written config does not load back to the planned one")
    return path
