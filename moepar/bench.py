"""Benchmarks: `moepar bench moe-layer` times the MoE layer against its ideal and a naive loop.

moe-layer: forward + backward of one MoE layer (dropless top-k, aux loss injected as in training),
of the ideal dense equivalent (one FFN of the expert's size on tokens*top_k rows: the same expert
FLOPs with no routing), and of a naive per-expert masked Python loop. The three are measured
alternately in one run, so machine noise hits them alike; medians are reported.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from moepar.layers import FeedForward, MoE

__all__ = ["main", "bench_moe_layer"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _naive_moe(moe: MoE, x_TD):
    """Reference cost: route with the layer's router, then one masked block per expert."""
    routing, losses, _ = moe.router(x_TD)
    num_experts, top_k = moe.num_experts, moe.top_k
    experts_TK = routing.expert_N.view(-1, top_k)
    weights_TK = routing.weight_N.view(-1, top_k)
    y_TD = torch.zeros_like(x_TD)
    w_in, w_out = moe.experts.w_in_EDH, moe.experts.w_out_EFD
    for e in range(num_experts):
        token_idx, slot = torch.where(experts_TK == e)
        if token_idx.numel() == 0:
            continue
        gate, up = (x_TD[token_idx] @ w_in[e]).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ w_out[e]
        y_TD = y_TD.index_add(0, token_idx, out * weights_TK[token_idx, slot, None].to(out.dtype))
    return y_TD + 0 * losses.total


def bench_moe_layer(tokens=4096, dim=512, ffn_dim=1024, experts=8, top_k=2, dtype="float32",
                    repeats=11, warmup=2, seed=0) -> dict:
    torch.manual_seed(seed)
    dt = _DTYPES[dtype]
    moe = MoE(dim, ffn_dim, experts, top_k, aux_loss_scale=1.0, balance_coeff=0.01).to(dt)
    ideal = FeedForward(dim, ffn_dim).to(dt)
    x_TD = torch.randn(tokens, dim, dtype=dt, requires_grad=True)
    x_rows = torch.randn(tokens * top_k, dim, dtype=dt, requires_grad=True)
    grad_TD = torch.randn(tokens, dim, dtype=dt)
    grad_rows = torch.randn(tokens * top_k, dim, dtype=dt)

    def run_moe():
        moe(x_TD).y.backward(grad_TD)

    def run_ideal():
        ideal(x_rows).backward(grad_rows)

    def run_naive():
        _naive_moe(moe, x_TD).backward(grad_TD)

    cases = {"moe": run_moe, "ideal": run_ideal, "naive": run_naive}
    times = {name: [] for name in cases}
    for rep in range(warmup + repeats):
        for name, fn in cases.items():
            for p in list(moe.parameters()) + list(ideal.parameters()) + [x_TD, x_rows]:
                p.grad = None
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[name].append(elapsed * 1000)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    paired = statistics.median(m / i for m, i in zip(times["moe"], times["ideal"]))
    return {"tokens": tokens, "dim": dim, "ffn_dim": ffn_dim, "experts": experts, "top_k": top_k,
            "dtype": dtype, "threads": torch.get_num_threads(), "repeats": repeats,
            "moe_ms": med["moe"], "ideal_ms": med["ideal"], "naive_ms": med["naive"],
            "ratio_vs_ideal": med["moe"] / med["ideal"],
            "paired_ratio_vs_ideal": paired,
            "naive_ratio_vs_ideal": med["naive"] / med["ideal"]}


def _print_dispatch(result: dict):
    print(f"dispatch ep={result['ep']} T={result['tokens_per_rank']}/rank D={result['dim']} "
          f"E={result['experts']} k={result['top_k']} {result['dtype']}; minimum "
          f"{result['min_bytes_per_token']:.0f} bytes/token (k*D*bytes*(ep-1)/ep, both ways)")
    print(f"  {'dispatcher':16s} {'ms':>8s} {'bytes/token':>12s} {'vs min':>7s} {'incl. ids':>10s} "
          f"{'comm share':>10s}")
    for name, c in result["cases"].items():
        share = "-" if c["comm_share"] is None else f"{100 * c['comm_share']:.0f}%"
        print(f"  {name:16s} {c['ms']:8.1f} {c['bytes_per_token_hidden']:12.0f} {c['vs_minimum']:7.3f} "
              f"{c['bytes_per_token_all']:10.0f} {share:>10s}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moepar bench")
    parser.add_argument("what", choices=["moe-layer", "dispatch", "memory", "pipeline"])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens (per rank under --ep)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn-dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", choices=list(_DTYPES), default="float32")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel processes (local, gloo)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    memory.add_argument("--dp", type=int, default=1, help="data-parallel processes (local, gloo)")
    memory.add_argument("--tp", type=int, default=1, help="tensor-parallel processes per dp rank")
    memory.add_argument("--layers", type=int, default=4)
    memory.add_argument("--heads", type=int, default=8)
    memory.add_argument("--kv-heads", type=int, default=0, help="key/value heads (0: --heads)")
    memory.add_argument("--micro-batch", type=int, default=1)
    pipe = parser.add_argument_group("pipeline")
    pipe.add_argument("--pp", type=int, default=2, help="pipeline processes (local, gloo)")
    pipe.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    pipe.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved_1f1b"], default="1f1b")
    pipe.add_argument("--virtual", type=int, default=2, help="chunks per rank (interleaved)")
    pipe.add_argument("--seq", type=int, default=128, help="sequence length")
    args = parser.parse_args(argv)
    if args.what == "pipeline":
        return _main_pipeline(args, argv)
    if args.what == "memory":
        return _main_memory(args, argv)
    if args.what == "dispatch" and args.ep < 2:
        parser.error("dispatch needs --ep >= 2")
    if args.ep > 1 or args.what == "dispatch":
        return _main_ep(args, argv)
    result = bench_moe_layer(args.tokens, args.dim, args.ffn_dim, args.experts, args.top_k,
                             args.dtype, args.repeats, args.warmup)
    if args.json:
        print(json.dumps(result))
    else:
        _print_layer(result, args)
    return 0


def _print_layer(result: dict, args):
    where = f"ep={args.ep}, 1 thread per rank, T per rank" if args.ep > 1 else \
        f"{result.get('threads', 1)} threads"
    print(f"moe-layer T={args.tokens} D={args.dim} F={args.ffn_dim} E={args.experts} "
          f"k={args.top_k} {args.dtype}, {where}, median of {args.repeats}:")
    print(f"  moe   {result['moe_ms']:9.1f} ms   ratio vs ideal {result['ratio_vs_ideal']:.3f} "
          f"(median of paired ratios {result['paired_ratio_vs_ideal']:.3f})")
    print(f"  ideal {result['ideal_ms']:9.1f} ms")
    if "naive_ms" in result:
        print(f"  naive {result['naive_ms']:9.1f} ms   ratio vs ideal {result['naive_ratio_vs_ideal']:.3f}")


def _main_pipeline(args, argv: list[str]) -> int:
    from moepar import bench_pipeline
    if "WORLD_SIZE" not in os.environ:
        from moepar.cli import launch
        return launch(args.pp, ["bench", *argv])
    result = bench_pipeline.worker_main(args)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result), flush=True) if args.json else bench_pipeline.print_result(result)
    return 0


def _main_memory(args, argv: list[str]) -> int:
    from moepar import bench_memory
    if args.dp * args.tp > 1 and not bench_memory.launched():
        from moepar.cli import launch
        return launch(args.dp * args.tp, ["bench", *argv])
    result = bench_memory.worker_main(args)
    if int(os.environ.get("RANK", 0)) == 0:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            bench_memory.print_result(result)
    return 0


def _main_ep(args, argv: list[str]) -> int:
    from moepar import bench_ep
    if not bench_ep.launched():
        from moepar.cli import launch
        return launch(args.ep, ["bench", *argv])
    if args.experts % args.ep:
        raise SystemExit(f"--experts {args.experts} must be divisible by --ep {args.ep}")
    result = bench_ep.worker_main(args, _DTYPES[args.dtype])
    if int(os.environ.get("RANK", 0)) == 0:
        if args.json:
            print(json.dumps(result), flush=True)
        elif args.what == "dispatch":
            _print_dispatch(result)
        else:
            _print_layer(result, args)
    return 0
