"""Profiles the MoE layer's forward + backward (the `moepar bench moe-layer` case) with
torch.profiler: the top operators by device time, per call.
    python scripts/profile_moe_layer.py [--tokens 16384 --dim 4096 --ffn-dim 14336 --experts 8
                                         --top-k 2 --dtype bfloat16 --device cuda]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from moepar.bench.moe_layer import DTYPES, PlainSwiGLU
from moepar.layers import MoE


def main():
    p = argparse.ArgumentParser()
    for name, default in (("tokens", 16384), ("dim", 4096), ("ffn-dim", 14336), ("experts", 8),
                          ("top-k", 2), ("repeats", 3), ("rows", 30)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    dt, device = DTYPES[a.dtype], torch.device(a.device)
    torch.manual_seed(0)
    moe = MoE(a.dim, a.ffn_dim, a.experts, a.top_k, aux_loss_scale=1.0,
              balance_coeff=0.01).to(device, dt)
    plain = PlainSwiGLU(a.dim, a.top_k * a.ffn_dim).to(device, dt)
    x_TD = torch.randn(a.tokens, a.dim, dtype=dt, device=device, requires_grad=True)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    for name, fn in (("moe", lambda: moe(x_TD).y.pow(2).mean().backward()),
                     ("plain", lambda: plain(x_TD).pow(2).mean().backward())):
        for _ in range(3):
            fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(a.repeats):
                fn()
            if cuda:
                torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(getattr(e, key) for e in events if not e.key.startswith(("void", "_Z", "cudnn",
                                                                              "nvjet", "sm90")))
        print(f"== {name}: {total / 1e3 / a.repeats:.1f} ms of operator {key} per call")
        print(events.table(sort_by=key, row_limit=a.rows, max_name_column_width=55))


if __name__ == "__main__":
    main()
