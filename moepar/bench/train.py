"""`moepar bench train --config FILE`: end-to-end training throughput of a config in one
process: tokens/s and model FLOPs utilisation (MFU).

Steps run through the real Trainer (data, forward, backward, clipping, AdamW); the first
`--warmup` are not timed; each timed step ends with a device synchronisation. Model FLOPs per
token are PaLM's count: 6 x the non-embedding parameters a token uses (the routed experts it
picks; the head counts, the embedding lookup does not) plus 12 x layers x sequence x (heads x
head dim) for attention scores and
values (MLA: heads x (q/k head dim + v head dim) / 2 per side), forward and backward. MFU is that
times tokens/s over the GPU's dense bf16 peak (`--peak-tflops`, or the spec of a known GPU).
"""

import statistics
import tempfile
import time

import torch

from moepar.bench.ticker import Ticker
from moepar.layers.shapes import param_count
from moepar.train import Trainer

__all__ = ["bench_train", "flops_per_token", "print_result", "PEAK_TFLOPS"]

# Dense bfloat16 spec peaks (no sparsity), TFLOP/s, matched on the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0}


def flops_per_token(cfg) -> float:
    """Training FLOPs per token (forward + backward) of cfg.model at cfg.train.seq_len."""
    model = cfg.model
    matmul = param_count(model)["active"] - model.vocab_size * model.dim   # no embedding lookup
    if model.tie_embeddings:
        matmul += model.vocab_size * model.dim                            # the head is the table
    if model.attention == "mla":
        width = model.num_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim
                                   + model.v_head_dim) / 2
    else:
        width = model.num_heads * model.head_dim_resolved
    return 6.0 * matmul + 12.0 * model.num_layers * cfg.train.seq_len * width


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(runs: dict, device, warmup: int, steps: int, tick) -> dict:
    """{name: seconds of each timed call}: the callables of `runs` called in turn, warmup + steps
    rounds (the first `warmup` untimed), so every one sees the same state of the machine."""
    times = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name, run in runs.items():
            sync_device(device)
            start = time.perf_counter()
            run()
            sync_device(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
        tick(i + 1)
    return times


def bench_train(cfg, steps: int = 10, warmup: int = 2, peak_tflops: float | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg.run.dir, cfg.run.tensorboard = tmp, False
        cfg.train.steps = warmup + steps
        trainer = Trainer(cfg, log=lambda _m: None, shared_run_dir=False)  # a scratch dir
        device = trainer.device
        times = []
        tick = Ticker("train", warmup, steps)
        for step in range(warmup + steps):
            sync_device(device)
            start = time.perf_counter()
            record = trainer.train_step()
            sync_device(device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
            tick(step + 1)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    per_token = flops_per_token(cfg)
    step_s = statistics.median(times)
    if peak_tflops is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    achieved = tokens / step_s * per_token
    return {"device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": cfg.train.dtype, "tokens_per_step": tokens, "step_ms": 1000 * step_s,
            "tokens_per_s": tokens / step_s, "flops_per_token": per_token,
            "achieved_tflops": achieved / 1e12, "peak_tflops": peak_tflops,
            "mfu": achieved / (peak_tflops * 1e12) if peak_tflops else None,
            "last_loss": record["loss"], "steps": steps}


def print_result(r: dict):
    mfu = f"{100 * r['mfu']:.1f}% of {r['peak_tflops']:.0f}" if r["mfu"] is not None else "n/a"
    print(f"train: {r['device_name']} {r['dtype']}; {r['tokens_per_step']} tokens/step, median "
          f"of {r['steps']} steps: {r['step_ms']:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, "
          f"{r['achieved_tflops']:.1f} TFLOP/s model FLOPs ({r['flops_per_token'] / 1e9:.2f} "
          f"GFLOP/token), MFU {mfu}")
