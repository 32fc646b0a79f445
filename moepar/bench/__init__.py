"""`moepar bench WHAT [options]`: one module per benchmark; this file parses and dispatches.

| benchmark  | module       | what it measures                                                    |
|------------|--------------|---------------------------------------------------------------------|
| moe-layer  | moe_layer.py | one MoE layer's forward + backward against dense floors (--ep N: EP) |
| dispatch   | ep.py        | bytes on the wire and all-to-all time of each EP dispatcher          |
| placement  | placement.py | skewed load: busiest EP rank's rows, layer time; contiguous/balanced |
| memory     | memory.py    | bytes per rank of parameters, gradients, optimizer state vs formula  |
| pipeline   | pipeline.py  | measured bubble and activation memory per pipeline stage             |
| checkpoint | checkpoint.py| build, save and load seconds and peak memory per rank vs its shard   |
| train      | train.py     | end-to-end tokens/s and MFU of a config in one process              |
| traffic    | traffic.py   | bytes each part of one training step moves (eager), and a roofline  |
| optimizer  | optimizer.py | Muon's optimizer step and training step against AdamW's (one process)|

Benchmarks that need several processes start them with torch's launcher and re-run the same
command line in each worker; rank 0 prints. Progress of a long benchmark (`Ticker`) goes to
stderr, so `--json` keeps stdout one JSON object.
"""

import argparse
import json
import os
import sys

from moepar.bench import (checkpoint, ep, hf_baseline, memory, moe_layer, optimizer, pipeline,
                          placement, simulate, traffic, train)
from moepar.bench.ticker import Ticker
from moepar.config import load_config
from moepar.launch import launch
from moepar.plan.hardware import PRESETS

__all__ = ["main", "build_parser", "Ticker"]


def _layer_options(p):
    p.add_argument("--tokens", type=int, default=4096, help="tokens (per rank under --ep)")
    p.add_argument("--dim", type=int, default=512, help="model dim")
    p.add_argument("--ffn-dim", type=int, default=1024, help="hidden dim of each expert")
    p.add_argument("--experts", type=int, default=8, help="routed experts")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32")


def _timing_options(p):
    p.add_argument("--repeats", type=int, default=11, help="timed repeats (medians reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repeats first")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moepar bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    p = sub.add_parser("moe-layer", help="MoE layer vs its dense floors",
                       description="Forward + backward of one MoE layer (dropless top-k) against "
                                   "dense floors and a naive per-expert loop, alternately.")
    _layer_options(p)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel processes (local, gloo)")
    p.add_argument("--a2a-chunks", type=int, default=1,
                   help="expert chunks pipelined between the all-to-alls (parallel.a2a_chunks)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the single-process layer runs (cuda: TFLOP/s and share of peak)")
    _timing_options(p)
    p = sub.add_parser("dispatch", help="bytes on the wire per EP dispatcher",
                       description="Each dispatcher over --ep local processes: bytes per token "
                                   "against the minimum, and the all-to-all share of the time.")
    _layer_options(p)
    p.add_argument("--ep", type=int, required=True, help="expert-parallel processes (>= 2)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="ranks per (pretend) node: adds the hierarchical dispatcher and the bytes "
                        "that leave each node (0: one node)")
    p.add_argument("--n-group", type=int, default=1,
                   help="expert groups of group-limited routing (router.n_group)")
    p.add_argument("--topk-group", type=int, default=1,
                   help="groups each token may use (router.topk_group)")
    p.add_argument("--a2a-chunks", type=int, default=1,
                   help="expert chunks pipelined between the all-to-alls (parallel.a2a_chunks)")
    _timing_options(p)
    p = sub.add_parser("placement", help="skewed load: contiguous vs balanced expert placement",
                       description="One EP MoE layer under a skewed load, contiguous and balanced "
                                   "from its measured load: busiest rank's rows over the mean, "
                                   "and forward + backward time.")
    _layer_options(p)
    p.add_argument("--ep", type=int, required=True, help="expert-parallel processes (>= 2)")
    p.add_argument("--skew", type=float, default=0.5,
                   help="router selection bias on expert 0, falling linearly to 0 on the last")
    p.add_argument("--replicas", type=int, default=1,
                   help="replica slots per rank (parallel.expert_replicas)")
    _timing_options(p)
    p = sub.add_parser("memory", help="bytes per rank against the ZeRO formula",
                       description="Builds a model, trains one step on dp*tp local processes and "
                                   "counts each rank's bytes against the formula.")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage")
    p.add_argument("--dp", type=int, default=1, help="data-parallel processes (local, gloo)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel processes per dp rank")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    p.add_argument("--dim", type=int, default=512, help="model dim")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (0: --heads)")
    p.add_argument("--experts", type=int, default=8, help="routed experts")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--simulate", action="store_true",
                   help="no processes: build --config's model on the meta device for sampled "
                        "ranks of a world of --world ranks (fake process group) and count bytes")
    p.add_argument("--world", type=int, default=0, help="world size to simulate")
    p.add_argument("--config", help="the run config to simulate (its [parallel] layout)")
    p.add_argument("--ranks", default="", help="ranks to simulate, e.g. 0,17,63 (default: the "
                                              "first rank of every stage and the last rank)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("pipeline", help="measured bubble and activation memory per stage",
                       description="Trains a few steps on --pp local processes and reports per "
                                   "stage the measured bubble and peak saved activations.")
    p.add_argument("--pp", type=int, default=2, help="pipeline processes (local, gloo)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved_1f1b"], default="1f1b")
    p.add_argument("--virtual", type=int, default=2, help="chunks per rank (interleaved only)")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--dim", type=int, default=256, help="model dim")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--experts", type=int, default=8, help="routed experts")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--repeats", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("checkpoint", help="build/save/load time and peak memory per rank",
                       description="Builds a model of --size-gb on --nproc local processes, "
                                   "trains one step, saves and loads a checkpoint; per rank the "
                                   "seconds and peak resident growth of each phase against its "
                                   "shard bytes.")
    p.add_argument("--nproc", type=int, default=4, help="local processes (gloo)")
    p.add_argument("--size-gb", type=float, default=1.0, help="total model size (float32)")
    p.add_argument("--ep", type=int, default=0, help="expert-parallel degree (0: --nproc)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: /tmp)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("train", help="end-to-end tokens/s and MFU of a config",
                       description="Trains --config in one process (real Trainer) and reports "
                                   "tokens/s, model TFLOP/s and MFU against the GPU's bf16 peak.")
    p.add_argument("--config", required=True, help="the run config, e.g. examples/moe_1b.toml")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak (default: the bf16 spec of a known GPU)")
    p.add_argument("--against-hf", action="store_true",
                   help="alternate steps with a plain PyTorch loop over transformers' "
                        "MixtralForCausalLM of the same shapes and report the ratio")
    p.add_argument("--hf-experts", default=None,
                   help="transformers' experts_implementation for --against-hf (default: "
                        "transformers' own default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("optimizer", help="Muon against AdamW, per training step",
                       description="Trains --config in one process with AdamW and with Muon, "
                                   "step by step alternately, and reports each optimizer step and "
                                   "training step (medians).")
    p.add_argument("--config", required=True, help="the run config, e.g. examples/tiny.toml")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--steps", type=int, default=5, help="timed steps of each optimizer")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("traffic", help="memory traffic of one training step, and a roofline",
                       description="Counts the bytes every aten op of one training step of CONFIG "
                                   "reads and writes (eager mode, one process) by part of the "
                                   "model and class of op; matmul FLOPs apart; a roofline step "
                                   "time for a GPU. Config overrides as `moepar train`'s "
                                   "(--section.key=value) follow.")
    p.add_argument("config", help="the run config: a TOML file or a packaged example's name")
    p.add_argument("--gpu", choices=list(PRESETS), default="h200-141g",
                   help="the planner's GPU preset for the roofline")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON")
    return parser


def _rank0() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


def _launched() -> bool:
    return "WORLD_SIZE" in os.environ


def _relaunch(nproc: int, argv: list[str]) -> int:
    return launch(nproc, ["bench", *argv])


def main(argv: list[str]) -> int:
    parser = build_parser()
    # `bench traffic` and `bench train` also take `moepar train`'s config overrides
    # (--section.key=value): the arguments argparse does not know.
    args, overrides = parser.parse_known_args(argv)
    if args.what == "traffic":
        return _traffic(args, overrides)
    if overrides and args.what not in ("train", "optimizer"):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.what == "pipeline":
        if not _launched():
            return _relaunch(args.pp, argv)
        result = pipeline.worker_main(args)
        if _rank0():
            print(json.dumps(result), flush=True) if args.json else pipeline.print_result(result)
        return 0
    if args.what == "checkpoint":
        if args.nproc > 1 and not _launched():
            return _relaunch(args.nproc, argv)
        result = checkpoint.worker_main(args)
        if _rank0():
            print(json.dumps(result), flush=True) if args.json else checkpoint.print_result(result)
        return 0
    if args.what == "optimizer":
        try:
            cfg = load_config(args.config, [*overrides, f"--train.device={args.device}"])
        except ValueError as e:
            print(f"moepar bench optimizer: {e}", file=sys.stderr)
            return 2
        result = optimizer.bench_optimizer(cfg, args.steps, args.warmup)
        print(json.dumps(result)) if args.json else optimizer.print_result(result)
        return 0
    if args.what == "train":
        try:
            cfg = load_config(args.config, [*overrides, f"--train.device={args.device}"])
            if args.against_hf:
                hf_baseline.check_mixtral(cfg)   # refuses what Mixtral cannot run, first
        except ValueError as e:
            print(f"moepar bench train: {e}", file=sys.stderr)
            return 2
        if args.against_hf:
            result = hf_baseline.bench_against_hf(cfg, args.steps, args.warmup, args.hf_experts)
            print(json.dumps(result)) if args.json else hf_baseline.print_comparison(result)
            return 0
        result = train.bench_train(cfg, args.steps, args.warmup, args.peak_tflops)
        print(json.dumps(result)) if args.json else train.print_result(result)
        return 0
    if args.what == "memory" and args.simulate:
        return _simulate(parser, args)
    if args.what == "memory":
        if args.dp * args.tp > 1 and not _launched():
            return _relaunch(args.dp * args.tp, argv)
        result = memory.worker_main(args)
        if _rank0():
            print(json.dumps(result), flush=True) if args.json else memory.print_result(result)
        return 0
    if args.what == "dispatch" and args.ep < 2:
        parser.error("dispatch needs --ep >= 2")
    if args.what == "dispatch" and (args.gpus_per_node < 0 or (
            0 < args.gpus_per_node < args.ep and args.ep % args.gpus_per_node)):
        parser.error(f"--gpus-per-node {args.gpus_per_node} must divide --ep {args.ep}")
    if args.what == "placement" and args.ep < 2:
        parser.error("placement needs --ep >= 2")
    if args.what == "placement":
        if args.experts % args.ep or args.replicas < 0:
            parser.error(f"--experts {args.experts} must be divisible by --ep {args.ep}, and "
                         f"--replicas {args.replicas} >= 0")
        if not _launched():
            return _relaunch(args.ep, argv)
        result = placement.worker_main(args, moe_layer.DTYPES[args.dtype])
        if _rank0():
            print(json.dumps(result), flush=True) if args.json else placement.print_result(result)
        return 0
    if args.ep > 1 or args.what == "dispatch":
        if args.experts % args.ep:
            parser.error(f"--experts {args.experts} must be divisible by --ep {args.ep}")
        if not _launched():
            return _relaunch(args.ep, argv)
        result = ep.worker_main(args, moe_layer.DTYPES[args.dtype])
        if _rank0():
            if args.json:
                print(json.dumps(result), flush=True)
            elif args.what == "dispatch":
                ep.print_dispatch(result)
            else:
                moe_layer.print_layer(result, args)
        return 0
    result = moe_layer.bench_moe_layer(args.tokens, args.dim, args.ffn_dim, args.experts,
                                       args.top_k, args.dtype, args.repeats, args.warmup,
                                       device=args.device)
    print(json.dumps(result)) if args.json else moe_layer.print_layer(result, args)
    return 0


def _traffic(args, overrides: list[str]) -> int:
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as e:
        print(f"moepar: {e}", file=sys.stderr)
        return 2
    result = traffic.bench_traffic(cfg, args.gpu)
    traffic.print_result(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


def _simulate(parser, args) -> int:
    if not args.config or args.world < 1:
        parser.error("--simulate needs --config FILE and --world N")
    try:
        cfg = load_config(args.config)
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()] or None
        result = simulate.simulate(cfg, args.world, ranks)
    except ValueError as e:
        print(f"moepar: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result)) if args.json else simulate.print_result(result)
    return 0
