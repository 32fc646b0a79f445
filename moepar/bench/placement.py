"""`moepar bench placement --ep N`: one EP MoE layer under a skewed load, with the contiguous
placement and with the balanced one computed from the load it measured (parallel.expert_placement,
parallel.expert_replicas): the busiest EP rank's rows over the mean, and the forward + backward
time of the layer (a step is as slow as its slowest rank), each placement timed alternately.

The skew: the router's selection bias (layers/router.py `expert_bias_E`) falls linearly from
`--skew` on expert 0 to 0 on the last, so the low-numbered experts, which the contiguous layout
puts on rank 0, take most copies; the same tokens and weights run under both placements.
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

from moepar.bench.ep import setup
from moepar.bench.ticker import Ticker
from moepar.layers import MoE
from moepar.parallel.expert import apply_ep
from moepar.parallel.expert_map import balanced, contiguous, rank_rows
from moepar.process import end_process_group

__all__ = ["worker_main", "print_result"]


def _layer(args, dtype, rank, dims, meshes, expert_map):
    torch.manual_seed(0)   # the same router and experts on every rank, and for both placements
    moe = MoE(args.dim, args.ffn_dim, args.experts, args.top_k).to(dtype)
    with torch.no_grad():
        moe.router.expert_bias_E.copy_(torch.linspace(args.skew, 0.0, args.experts))
    return apply_ep(moe, dims, meshes, rank, expert_maps={0: expert_map})


def _rows_per_rank(moe, x) -> list[float]:
    """The rows each EP rank's experts received in one forward (gathered from every rank)."""
    with torch.no_grad():
        routing = moe.router(x)[0]
        x_RD, plan = moe.dispatcher.dispatch(x, routing)
        moe.dispatcher.combine(moe.experts(x_RD, plan), plan, routing.weight_N)
    rows = torch.tensor([float(sum(plan.rows_per_expert))], dtype=torch.float64)
    out = [torch.zeros_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(out, rows)
    return [float(r) for r in out]


def _load(moe, x) -> list[float]:
    """Routed copies per logical expert over the EP group (what expert_load.jsonl records)."""
    with torch.no_grad():
        tokens_E = moe.router(x)[2].tokens_per_expert_E.to(torch.float64)
    dist.all_reduce(tokens_E)
    return tokens_E.tolist()


def bench_placement(args, dtype) -> dict:
    rank, dims, meshes = setup(args.ep, args.experts)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.dim, dtype=dtype, generator=gen, requires_grad=True)
    before = _layer(args, dtype, rank, dims, meshes, contiguous(args.experts, args.ep))
    load_E = _load(before, x)
    placed = balanced(load_E, args.ep, args.replicas)
    after = _layer(args, dtype, rank, dims, meshes, placed)
    layers = {"contiguous": before, "balanced": after}
    rows = {name: _rows_per_rank(moe, x) for name, moe in layers.items()}
    times = {name: [] for name in layers}
    tick = Ticker("placement", args.warmup, args.repeats)
    for rep in range(args.warmup + args.repeats):
        for name, moe in layers.items():
            x.grad = None
            for p in moe.parameters():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            moe(x).y.pow(2).mean().backward()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # the slowest rank sets the step
            if rep >= args.warmup:
                times[name].append(float(elapsed) * 1000)
        tick(rep + 1)
    out = {"ep": args.ep, "tokens_per_rank": args.tokens, "dim": args.dim, "ffn_dim": args.ffn_dim,
           "experts": args.experts, "top_k": args.top_k, "dtype": args.dtype, "skew": args.skew,
           "replicas": args.replicas, "repeats": args.repeats, "load_E": load_E,
           "placement": placed.per_rank()}
    for name in layers:
        mean = sum(rows[name]) / len(rows[name])
        out[name] = {"rows_per_rank": rows[name], "max_over_mean": max(rows[name]) / mean,
                     "ms": statistics.median(times[name])}
    predicted = rank_rows(placed, load_E)
    out["balanced"]["predicted_max_over_mean"] = max(predicted) / (sum(predicted) / len(predicted))
    return out


def worker_main(args, dtype) -> dict:
    try:
        return bench_placement(args, dtype)
    finally:
        end_process_group(clean=sys.exc_info()[0] is None)


def print_result(r: dict):
    print(f"placement ep={r['ep']} T={r['tokens_per_rank']}/rank D={r['dim']} F={r['ffn_dim']} "
          f"E={r['experts']} k={r['top_k']} {r['dtype']} skew={r['skew']} replicas={r['replicas']}")
    print(f"  {'placement':12s} {'busiest/mean':>12s} {'ms (fwd+bwd)':>13s}  rows per rank")
    for name in ("contiguous", "balanced"):
        c = r[name]
        print(f"  {name:12s} {c['max_over_mean']:12.3f} {c['ms']:13.1f}  "
              f"{[int(v) for v in c['rows_per_rank']]}")
    print(f"  speed-up {r['contiguous']['ms'] / r['balanced']['ms']:.2f}x; balanced slots per "
          f"rank (owned, then replicas): {r['placement']}")
