"""Profiles a few training steps of a config with torch.profiler and prints where the time goes:
the top kernels / operators by device time, and device busy time against wall time per step.
    python scripts/profile_train.py examples/moe_1b.toml [--steps 3] [--warmup 3] [--trace DIR]
"""

import argparse
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moepar.config import load_config
from moepar.train import Trainer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--trace", default="", help="write a Chrome trace here")
    parser.add_argument("--rows", type=int, default=35)
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.run.dir, cfg.run.tensorboard, cfg.run.log_every = tmp, False, 0
        cfg.train.steps = args.warmup + args.steps
        trainer = Trainer(cfg, log=lambda _m: None)
        cuda = trainer.device.type == "cuda"
        for _ in range(args.warmup):
            trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        start = time.perf_counter()
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(args.steps):
                trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
    if cuda:
        busy = sum(e.self_device_time_total for e in events) / 1e3 / args.steps
        print(f"per step: wall {1e3 * wall:.1f} ms, device busy {busy:.1f} ms "
              f"({100 * busy / (1e3 * wall):.0f}%)")
        shapes = prof.key_averages(group_by_input_shape=True)
        print(shapes.table(sort_by=key, row_limit=25, max_name_column_width=50,
                           max_shapes_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
