"""`moepar bench memory --simulate --world N --config FILE`: bytes per rank of parameters,
gradients and AdamW state for a world that does not exist, from the real model built on the
meta device for a sample of ranks.

Each sampled rank gets a fake process group of N ranks (fakeworld.py), then the trainer's own
path: the config's layout validated, the model built on meta, `parallelize` (EP, TP, pipeline
split, ZeRO) applied without materializing. Bytes are counted from the tensors that result:
parameters (local shards), gradients as the gradient sync will hold them, and AdamW's two
moments over whatever the optimizer steps. `moepar/plan/memory.py` gives the same numbers in
closed form (a test checks they agree).
"""

import math

import torch

from moepar.build import build_dims, build_engine
from moepar.dryrun import activations
from moepar.parallel.placement import local_tensor

from .fakeworld import fake_process_group

__all__ = ["simulate", "default_ranks", "print_result"]


def default_ranks(dims) -> list[int]:
    """The first rank of every pipeline stage, and the last rank of the world."""
    stage = dims.stage_size
    return sorted({s * stage for s in range(dims.pp)} | {dims.world_size - 1})


def _rank_bytes(engine, zero: int) -> dict:
    """Bytes of this rank's masters (what the optimizer steps), gradients and AdamW state, and
    of the compute copies bf16 training keeps beside the masters (0 otherwise)."""
    params = list(engine.model.parameters())
    masters = engine.masters.masters(params)
    elem = masters[0].element_size()
    local = sum(local_tensor(m).numel() for m in masters)
    compute = sum(local_tensor(p).numel() * p.element_size()
                  for p, m in zip(params, masters, strict=True) if p is not m)
    sync = engine.sync
    if zero in (1, 2):
        shards = sum(b.shard.numel() for b in sync.buckets)
        grads = shards if zero == 2 else local
        stepped = shards
    else:
        grads = stepped = local
    return {"params": elem * local, "compute_weights": compute, "grads": elem * grads,
            "optimizer": 2 * elem * stepped, "buckets": len(getattr(sync, "buckets", []))}


def simulate(cfg, world: int, ranks: list[int] | None = None) -> dict:
    """{'ranks': [per sampled rank: coords and bytes], ...} for `cfg` on a world of `world`."""
    dims = build_dims(cfg, world)
    ranks = default_ranks(dims) if ranks is None else ranks
    out = []
    for rank in ranks:
        with fake_process_group(rank, world):
            device = torch.device("cpu")
            engine = build_engine(cfg, dims.bind(rank, device), device,
                                  cfg.train.num_micro_batches // dims.dp, materialize=False)
            coords = engine.layout.coords
            out.append({"rank": rank, "pp": coords.pp, "dp": coords.dp, "cp": coords.cp,
                        "tp": coords.tp,
                        "ep": coords.ep, "edp": coords.edp,
                        "moe_layers": [engine.moe_layer_ids[i] for i in engine.moe_indices],
                        **_rank_bytes(engine, cfg.parallel.zero)})
    total = sum(math.prod(t.shape) for t in engine.canonical.values() if t.trainable)
    return {"world": world, "layout": dims.describe(), "zero": cfg.parallel.zero,
            "total_params": total, "ranks": out, "activations": activations(cfg, dims)}


def print_result(result: dict):
    gb = 1e9
    print(f"simulated: {result['layout']}; zero {result['zero']}; "
          f"{result['total_params'] / 1e9:.1f}B parameters")
    print(f"  {'rank':>5} {'pp':>3} {'params GB':>10} {'grads GB':>9} {'adam GB':>8} {'total GB':>9}")
    for r in result["ranks"]:
        total = r["params"] + r["grads"] + r["optimizer"]
        print(f"  {r['rank']:>5} {r['pp']:>3} {r['params'] / gb:>10.2f} {r['grads'] / gb:>9.2f} "
              f"{r['optimizer'] / gb:>8.2f} {total / gb:>9.2f}")
    act = result.get("activations")
    if act:
        print(f"activations on rank 0 (`moepar plan`'s estimate on GPUs, on top): "
              f"{act['total'] / gb:.2f} GB at the peak, {act['in_flight']} micro-batch(es) in "
              f"flight, {act['positions']:,} positions of each sequence per rank")
