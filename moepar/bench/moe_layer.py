"""`moepar bench moe-layer`: the MoE layer against its ideal and a naive loop.

moe-layer: forward + backward of one MoE layer (dropless top-k, aux loss injected as in training),
of the ideal dense equivalent (one FFN of the expert's size on tokens*top_k rows: the same expert
FLOPs with no routing), and of a naive per-expert masked Python loop. The three are measured
alternately in one run, so machine noise hits them alike; medians are reported.
"""

import statistics
import time

import torch
import torch.nn.functional as F

from moepar.layers import FeedForward, MoE

__all__ = ["bench_moe_layer", "print_layer", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


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
    dt = DTYPES[dtype]
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


def print_layer(result: dict, args):
    where = f"ep={args.ep}, 1 thread per rank, T per rank" if args.ep > 1 else \
        f"{result.get('threads', 1)} threads"
    print(f"moe-layer T={args.tokens} D={args.dim} F={args.ffn_dim} E={args.experts} "
          f"k={args.top_k} {args.dtype}, {where}, median of {args.repeats}:")
    print(f"  moe   {result['moe_ms']:9.1f} ms   ratio vs ideal {result['ratio_vs_ideal']:.3f} "
          f"(median of paired ratios {result['paired_ratio_vs_ideal']:.3f})")
    print(f"  ideal {result['ideal_ms']:9.1f} ms")
    if "naive_ms" in result:
        print(f"  naive {result['naive_ms']:9.1f} ms   ratio vs ideal {result['naive_ratio_vs_ideal']:.3f}")
