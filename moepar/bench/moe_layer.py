"""`moepar bench moe-layer`: the MoE layer against two dense floors and a naive loop.

Forward + backward, loss y.pow(2).mean() for every case, of:

| case  | what                                                                              |
|-------|-----------------------------------------------------------------------------------|
| moe   | one MoE layer (dropless top-k, aux loss injected as in training)                  |
| plain | the plain floor: T rows through an nn.Linear SwiGLU of hidden k*ffn (same FLOPs)  |
| ideal | moepar's FeedForward of the expert's size on T*k rows (same FLOPs, no routing)    |
| naive | a per-expert masked Python loop over the same router and weights                 |

The cases are measured alternately in one run, so machine noise hits them alike; medians and
the median of paired ratios (each repeat's moe time over the same repeat's floor) are reported.
The plain floor is what other MoE implementations are compared against.
"""

import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from moepar.bench.ticker import Ticker
from moepar.bench.train import PEAK_TFLOPS
from moepar.layers import FeedForward, MoE

__all__ = ["bench_moe_layer", "print_layer", "DTYPES", "PlainSwiGLU"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _naive_moe(moe: MoE, x_TD):
    """Reference cost: route with the layer's router, then one masked block per expert."""
    routing, losses, _ = moe.router(x_TD)
    num_experts, top_k = moe.num_experts, moe.top_k
    experts_TK = routing.expert_N.view(-1, top_k)
    weights_TK = routing.weight_N.view(-1, top_k)
    y_TD = torch.zeros_like(x_TD)
    w_in, w_out = moe.experts.w_in_EDU, moe.experts.w_out_EFD
    for e in range(num_experts):
        token_idx, slot = torch.where(experts_TK == e)
        if token_idx.numel() == 0:
            continue
        gate, up = (x_TD[token_idx] @ w_in[e]).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ w_out[e]
        y_TD = y_TD.index_add(0, token_idx, out * weights_TK[token_idx, slot, None].to(out.dtype))
    return y_TD + 0 * losses.total


class PlainSwiGLU(nn.Module):
    """The plain floor: one nn.Linear SwiGLU of hidden top_k * ffn_dim on the T tokens (the MoE
    layer's expert FLOPs, as one dense GEMM pair with no routing)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)


def paired_ratio(times: dict, name: str, floor: str) -> float:
    return statistics.median(m / f for m, f in zip(times[name], times[floor], strict=True))


def bench_moe_layer(tokens=4096, dim=512, ffn_dim=1024, experts=8, top_k=2, dtype="float32",
                    repeats=11, warmup=2, seed=0, device="cpu") -> dict:
    torch.manual_seed(seed)
    dt, device = DTYPES[dtype], torch.device(device)
    moe = MoE(dim, ffn_dim, experts, top_k, aux_loss_scale=1.0, balance_coeff=0.01).to(device, dt)
    ideal = FeedForward(dim, ffn_dim).to(device, dt)
    plain = PlainSwiGLU(dim, top_k * ffn_dim).to(device, dt)
    x_TD = torch.randn(tokens, dim, dtype=dt, device=device, requires_grad=True)
    x_rows = torch.randn(tokens * top_k, dim, dtype=dt, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cases = {"moe": lambda: moe(x_TD).y.pow(2).mean().backward(),
             "plain": lambda: plain(x_TD).pow(2).mean().backward(),
             "ideal": lambda: ideal(x_rows).pow(2).mean().backward(),
             "naive": lambda: _naive_moe(moe, x_TD).pow(2).mean().backward()}
    leaves = [*moe.parameters(), *ideal.parameters(), *plain.parameters(), x_TD, x_rows]
    times = {name: [] for name in cases}
    tick = Ticker("moe-layer", warmup, repeats)
    for rep in range(warmup + repeats):
        for name, fn in cases.items():
            for p in leaves:
                p.grad = None
            sync()
            start = time.perf_counter()
            fn()
            sync()
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[name].append(elapsed * 1000)
        tick(rep + 1)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    # Expert FLOPs of forward + backward: 3 x 2 x (T*k rows) x (D*2F + F*D) for SwiGLU.
    flops = 18.0 * tokens * top_k * dim * ffn_dim
    peak = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    tflops = {name: flops / (ms / 1000) / 1e12 for name, ms in med.items() if name != "naive"}
    return {"tokens": tokens, "dim": dim, "ffn_dim": ffn_dim, "experts": experts, "top_k": top_k,
            "dtype": dtype, "device": str(device), "threads": torch.get_num_threads(),
            "repeats": repeats, "expert_flops": flops,
            "moe_tflops": tflops["moe"], "plain_tflops": tflops["plain"], "peak_tflops": peak,
            "moe_fraction_of_peak": tflops["moe"] / peak if peak else None,
            "plain_fraction_of_peak": tflops["plain"] / peak if peak else None,
            "malloc_tuning": os.environ.get("MOEPAR_MALLOC_TUNING", "1") != "0",
            "moe_ms": med["moe"], "plain_ms": med["plain"], "ideal_ms": med["ideal"],
            "naive_ms": med["naive"],
            "ratio_vs_plain": med["moe"] / med["plain"],
            "paired_ratio_vs_plain": paired_ratio(times, "moe", "plain"),
            "ratio_vs_ideal": med["moe"] / med["ideal"],
            "paired_ratio_vs_ideal": paired_ratio(times, "moe", "ideal"),
            "naive_ratio_vs_plain": med["naive"] / med["plain"]}


def print_layer(result: dict, args):
    where = f"ep={args.ep}, 1 thread per rank, T per rank" if args.ep > 1 else \
        f"{result.get('threads', 1)} threads"
    tuning = "malloc tuning on" if result.get("malloc_tuning", True) else "MOEPAR_MALLOC_TUNING=0"
    print(f"moe-layer T={args.tokens} D={args.dim} F={args.ffn_dim} E={args.experts} "
          f"k={args.top_k} {args.dtype}, {where}, {tuning}, median of {args.repeats}:")
    print(f"  moe   {result['moe_ms']:9.1f} ms   ratio vs plain {result['ratio_vs_plain']:.3f} "
          f"(paired {result['paired_ratio_vs_plain']:.3f}), vs ideal {result['ratio_vs_ideal']:.3f} "
          f"(paired {result['paired_ratio_vs_ideal']:.3f})")
    print(f"  plain {result['plain_ms']:9.1f} ms   (T rows, nn.Linear SwiGLU of hidden k*ffn)")
    if result.get("moe_tflops") is not None:
        peak = result.get("peak_tflops")
        share = (lambda v: f" = {100 * v / peak:.1f}% of the {peak:.0f} TFLOP/s bf16 peak"
                 if peak else "")
        print(f"  expert TFLOP/s: moe {result['moe_tflops']:.1f}{share(result['moe_tflops'])}; "
              f"plain {result['plain_tflops']:.1f}{share(result['plain_tflops'])}")
    print(f"  ideal {result['ideal_ms']:9.1f} ms   (T*k rows, FeedForward of hidden ffn)")
    if "naive_ms" in result:
        print(f"  naive {result['naive_ms']:9.1f} ms   ratio vs plain {result['naive_ratio_vs_plain']:.3f}")
    if "a2a_total_ms" in result:
        print(f"  all-to-all {result['a2a_total_ms']:7.1f} ms in flight (fwd+bwd, "
              f"{result['a2a_chunks']} chunk(s)), {result['a2a_exposed_ms']:.1f} ms exposed "
              f"({100 * result['a2a_exposed_share']:.0f}% of total)")
        print(f"    of which waiting for the last rank to issue (load imbalance) "
              f"{result['a2a_peer_wait_ms']:.1f} ms; communication {result['a2a_comm_ms']:.1f} ms "
              f"= {100 * result['a2a_comm_share']:.0f}% of the {result['a2a_on_wire_ms']:.1f} ms "
              f"on the wire (last issue to completion)")
