"""Expert-parallel benchmarks over N local processes (gloo, one thread each).

`moepar bench dispatch --ep N`: forward + backward of one EP MoE layer with each dispatcher; the
bytes the forward's all-to-alls put on the wire (rows to other ranks only, counted from the real
split sizes; dispatch and combine) per token, against the minimum for top-k routing,
k * dim * bytes * (ep-1)/ep each way (backward moves the same again); and the share of the
forward + backward time spent inside all-to-all calls.

`moepar bench moe-layer --ep N`: each rank's EP MoE layer against its dense floors (the plain
SwiGLU on its own tokens, the ideal FFN on its tokens * k rows), alternately; a repeat costs what
the slowest rank took. Both benchmarks report the all-to-all time of the layer: `total` is the time
at least one all-to-all was in flight (forward and backward), `exposed` the time the host spent
on them (issuing, blocking, waiting): what the overlap did not hide.
"""

import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moepar.bench.moe_layer import PlainSwiGLU, paired_ratio
from moepar.bench.nodes import node_bytes
from moepar.bench.ticker import Ticker
from moepar.layers import FeedForward, MoE
from moepar.parallel.alltoall import AllToAllDispatcher
from moepar.parallel.comm import A2ATimer
from moepar.parallel.dims import ParallelDims
from moepar.parallel.expert import apply_ep
from moepar.parallel.hierarchical import node_layout
from moepar.process import end_process_group

__all__ = ["worker_main", "print_dispatch", "setup"]


class _Meter:
    def __init__(self, ranks_per_node: int = 0, dim: int = 0):
        self.seconds = 0.0
        self.float_bytes = 0
        self.int_bytes = 0
        self.ranks_per_node, self.dim = ranks_per_node, dim
        self.off_node_hidden = 0      # hidden-state bytes (rows of `dim`) to ranks on other nodes


@contextlib.contextmanager
def metered_all_to_all(meter: _Meter):
    """Counts remote bytes and wall time of every all_to_all_single while active."""
    real = dist.all_to_all_single

    def wrapped(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):
        start = time.perf_counter()
        result = real(output, input, output_split_sizes, input_split_sizes, group=group,
                      async_op=async_op)
        meter.seconds += time.perf_counter() - start
        size, me = dist.get_world_size(group), dist.get_rank(group)
        rows = input.shape[0]
        splits = input_split_sizes or [rows // size] * size
        row_bytes = (input[0].numel() if rows else 0) * input.element_size()
        remote = sum(s for j, s in enumerate(splits) if j != me) * row_bytes
        if input.is_floating_point():
            meter.float_bytes += remote
            if meter.ranks_per_node and input.dim() == 2 and input.shape[1] == meter.dim:
                node = meter.ranks_per_node
                meter.off_node_hidden += row_bytes * sum(
                    s for j, s in enumerate(splits) if j // node != me // node)
        else:
            meter.int_bytes += remote
        return result

    dist.all_to_all_single = wrapped
    try:
        yield meter
    finally:
        dist.all_to_all_single = real


def setup(ep: int, experts: int, gpus_per_node: int = 0):
    """(rank, dims, meshes) of an EP world of local gloo processes, one thread each."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = gpus_per_node if gpus_per_node < world else 0
    dims = ParallelDims.resolve(world, ep=ep, num_experts=experts, gpus_per_node=node)
    return rank, dims, dims.build_meshes("cpu")


def _moe(args, dtype, rank, dims, meshes, dispatcher="alltoall"):
    """The EP layer with an A2ATimer on its dispatcher (all-to-all dispatchers)."""
    torch.manual_seed(0)   # same router and experts on every rank before sharding
    groups = dict(n_group=getattr(args, "n_group", 1), topk_group=getattr(args, "topk_group", 1))
    moe = MoE(args.dim, args.ffn_dim, args.experts, args.top_k, aux_loss_scale=1.0,
              balance_coeff=0.01, **groups).to(dtype)
    moe = apply_ep(moe, dims, meshes, rank, dispatcher)
    if dispatcher == "alltoall" and args.a2a_chunks > 1:
        moe.dispatcher = AllToAllDispatcher(args.experts, meshes.group("ep"),
                                            chunks=args.a2a_chunks)
    if dispatcher in ("alltoall", "dedup", "hierarchical"):
        moe.dispatcher.timer = A2ATimer()
    return moe


A2A_PARTS = ("total", "exposed", "peer_wait", "comm", "on_wire")   # seconds, see _a2a_times


def _a2a_times(timer) -> dict:
    """The all-to-all seconds since the last reset, averaged over the ranks: `total`, `exposed`,
    and exposed parted into `peer_wait` (blocked until the last rank issued: load imbalance)
    and `comm`, with `on_wire` (from the last issue to completion). The ranks share one host,
    so their perf_counter clocks agree."""
    dist.barrier()   # every completion callback of this step has run
    issues = [None] * dist.get_world_size()
    dist.all_gather_object(issues, timer.issue_times)
    if len({len(i) for i in issues}) != 1:
        raise RuntimeError(f"the ranks issued different numbers of all-to-alls: "
                           f"{[len(i) for i in issues]}")
    parts = {"total": timer.total, "exposed": timer.exposed,
             **timer.split([max(times) for times in zip(*issues)])}
    values = torch.tensor([parts[name] for name in A2A_PARTS], dtype=torch.float64)
    dist.all_reduce(values)
    timer.reset()
    return dict(zip(A2A_PARTS, (values / dist.get_world_size()).tolist()))


def _counted_node_bytes(moe, x, args, esize: int, ranks: int) -> dict:
    """Bytes leaving each node per dispatcher (bench/nodes.py), counted from the routing the
    layer makes of every rank's tokens (the router is replicated: the same on every rank)."""
    with torch.no_grad():
        experts_TK = moe.router(x)[0].expert_N.view(args.tokens, -1).tolist()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, experts_TK)
    return node_bytes(every, args.ep, ranks, args.experts, args.dim * esize)


def bench_dispatch(args, dtype) -> dict:
    rank, dims, meshes = setup(args.ep, args.experts, args.gpus_per_node)
    ranks = node_layout(args.ep, dims.gpus_per_node, args.experts, args.n_group)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.dim, dtype=dtype, generator=gen, requires_grad=True)
    grad = torch.randn(args.tokens, args.dim, dtype=dtype, generator=gen)
    esize = torch.tensor([], dtype=dtype).element_size()
    minimum = 2 * args.top_k * args.dim * esize * (args.ep - 1) / args.ep
    out = {"ep": args.ep, "tokens_per_rank": args.tokens, "dim": args.dim, "experts": args.experts,
           "top_k": args.top_k, "n_group": args.n_group, "topk_group": args.topk_group,
           "dtype": args.dtype, "min_bytes_per_token": minimum, "cases": {}}
    names = ("alltoall", "dedup", "allgather") + (("hierarchical",) if ranks < args.ep else ())
    if ranks < args.ep:
        out["gpus_per_node"] = ranks
        out["node_bytes"] = _counted_node_bytes(_moe(args, dtype, rank, dims, meshes), x, args,
                                                esize, ranks)
    for name in names:
        moe = _moe(args, dtype, rank, dims, meshes, name)
        timer = getattr(moe.dispatcher, "timer", None)
        times, shares, floats, ints, a2a_total, a2a_exposed, off_node = [], [], [], [], [], [], []
        tick = Ticker(f"dispatch ({name})", args.warmup, args.repeats)
        for rep in range(args.warmup + args.repeats):
            x.grad = None
            dist.barrier()
            fwd, bwd = _Meter(ranks, args.dim), _Meter()
            if timer is not None:
                timer.reset()
            start = time.perf_counter()
            with metered_all_to_all(fwd):        # bytes: forward = dispatch + combine, once each
                y = moe(x).y
            with metered_all_to_all(bwd):
                y.backward(grad)
            elapsed = time.perf_counter() - start
            a2a = _a2a_times(timer) if timer is not None else dict.fromkeys(A2A_PARTS, 0.0)
            if rep >= args.warmup:
                times.append(elapsed)
                shares.append(a2a["exposed"] / elapsed)
                floats.append(fwd.float_bytes)
                ints.append(fwd.int_bytes)
                off_node.append(fwd.off_node_hidden)
                a2a_total.append(a2a["total"] * 1000)
                a2a_exposed.append(a2a["exposed"] * 1000)
            tick(rep + 1)
        # Bytes per token over the whole EP group (every rank's remote traffic, dispatch + combine).
        totals = torch.tensor([statistics.median(floats), statistics.median(ints)], dtype=torch.float64)
        dist.all_reduce(totals)
        group_tokens = args.tokens * dist.get_world_size()
        if name == "allgather":   # all_gather + reduce_scatter of every token, by formula
            totals[0] = 2 * args.tokens * (args.ep - 1) * args.dim * esize * dist.get_world_size()
        out["cases"][name] = {
            "ms": statistics.median(times) * 1000,
            "bytes_per_token_hidden": float(totals[0]) / group_tokens,
            "bytes_per_token_all": float(totals.sum()) / group_tokens,
            "vs_minimum": float(totals[0]) / group_tokens / minimum if minimum else 0.0,
            "comm_share": statistics.median(shares) if timer is not None else None,
            "a2a_total_ms": statistics.median(a2a_total) if timer is not None else None,
            "a2a_exposed_ms": statistics.median(a2a_exposed) if timer is not None else None,
        }
        if ranks < args.ep:     # measured from the real splits: what left each rank's node
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, statistics.median(off_node))
            out["cases"][name]["node_bytes_measured"] = [
                sum(every[n * ranks:(n + 1) * ranks]) for n in range(args.ep // ranks)]
    return out


def bench_moe_layer_ep(args, dtype) -> dict:
    rank, dims, meshes = setup(args.ep, args.experts)
    moe = _moe(args, dtype, rank, dims, meshes)
    ideal = FeedForward(args.dim, args.ffn_dim).to(dtype)
    plain = PlainSwiGLU(args.dim, args.top_k * args.ffn_dim).to(dtype)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.dim, dtype=dtype, generator=gen, requires_grad=True)
    rows = torch.randn(args.tokens * args.top_k, args.dim, dtype=dtype, generator=gen, requires_grad=True)
    cases = {"moe": lambda: moe(x).y.pow(2).mean().backward(),
             "plain": lambda: plain(x).pow(2).mean().backward(),
             "ideal": lambda: ideal(rows).pow(2).mean().backward()}
    leaves = [*moe.parameters(), *ideal.parameters(), *plain.parameters(), x, rows]
    times = {name: [] for name in cases}
    a2a = []
    tick = Ticker("moe-layer", args.warmup, args.repeats)
    for rep in range(args.warmup + args.repeats):
        for name, fn in cases.items():
            for p in leaves:
                p.grad = None
            moe.dispatcher.timer.reset()
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # a step is as slow as its slowest rank
            step_a2a = _a2a_times(moe.dispatcher.timer)
            if rep >= args.warmup:
                times[name].append(float(elapsed) * 1000)
                if name == "moe":
                    a2a.append(step_a2a)
        tick(rep + 1)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"ep": args.ep, "tokens_per_rank": args.tokens, "dim": args.dim, "ffn_dim": args.ffn_dim,
            "experts": args.experts, "top_k": args.top_k, "dtype": args.dtype, "threads_per_rank": 1,
            "repeats": args.repeats, "malloc_tuning": os.environ.get("MOEPAR_MALLOC_TUNING", "1") != "0",
            "moe_ms": med["moe"], "plain_ms": med["plain"], "ideal_ms": med["ideal"],
            "ratio_vs_plain": med["moe"] / med["plain"],
            "paired_ratio_vs_plain": paired_ratio(times, "moe", "plain"),
            "ratio_vs_ideal": med["moe"] / med["ideal"],
            "paired_ratio_vs_ideal": paired_ratio(times, "moe", "ideal"),
            "a2a_chunks": moe.dispatcher.chunks,
            **{f"a2a_{key}_ms": statistics.median(1000 * s[key] for s in a2a)
               for key in A2A_PARTS},
            "a2a_exposed_share": statistics.median(s["exposed"] / s["total"] for s in a2a if s["total"]),
            "a2a_comm_share": statistics.median(s["comm"] / s["on_wire"] for s in a2a if s["on_wire"])}


def worker_main(args, dtype) -> dict:
    """Runs on every rank (started by the launcher); returns the result (rank 0 prints it)."""
    try:
        if args.what == "dispatch":
            return bench_dispatch(args, dtype)
        return bench_moe_layer_ep(args, dtype)
    finally:
        end_process_group(clean=sys.exc_info()[0] is None)


def launched() -> bool:
    return "WORLD_SIZE" in os.environ


def print_dispatch(result: dict):
    print(f"dispatch ep={result['ep']} T={result['tokens_per_rank']}/rank D={result['dim']} "
          f"E={result['experts']} k={result['top_k']} groups {result['topk_group']} of "
          f"{result['n_group']} {result['dtype']}; minimum "
          f"{result['min_bytes_per_token']:.0f} bytes/token (k*D*bytes*(ep-1)/ep, both ways)")
    print(f"  {'dispatcher':16s} {'ms':>8s} {'bytes/token':>12s} {'vs min':>7s} {'incl. ids':>10s} "
          f"{'a2a total':>10s} {'exposed':>8s} {'of step':>8s}")
    for name, c in result["cases"].items():
        if c["comm_share"] is None:
            a2a = f"{'-':>10s} {'-':>8s} {'-':>8s}"
        else:
            a2a = (f"{c['a2a_total_ms']:8.1f}ms {c['a2a_exposed_ms']:6.1f}ms "
                   f"{100 * c['comm_share']:7.0f}%")
        print(f"  {name:16s} {c['ms']:8.1f} {c['bytes_per_token_hidden']:12.0f} {c['vs_minimum']:7.3f} "
              f"{c['bytes_per_token_all']:10.0f} {a2a}")
    if "node_bytes" in result:
        nodes = result["ep"] // result["gpus_per_node"]
        print(f"  bytes of hidden state that leave each node (forward: dispatch + combine), "
              f"{nodes} nodes of {result['gpus_per_node']} ranks; counted from the routing, "
              "and measured from the all-to-all splits:")
        for name, counted in result["node_bytes"].items():
            measured = result["cases"][name]["node_bytes_measured"]
            print(f"  {name:16s} counted {' '.join(f'{b:>12,d}' for b in counted)}   measured "
                  f"{' '.join(f'{b:>12,d}' for b in measured)}")
    print("  a2a total: time with an all-to-all in flight (forward + backward); exposed: time the "
          "host spent issuing and waiting on them (it can exceed the total on a loaded machine, "
          "where the waiting process resumes late)")
