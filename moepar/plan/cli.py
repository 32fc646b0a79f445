"""`moepar plan`: the layout that trains MODEL fastest on N GPUs, with memory and time estimates.

    moepar plan MODEL --gpus N [--gpu h100-80g] [--gpus-per-node 8] [--seq-len S]
                [--global-batch-tokens B] [--json] [--write plan.toml] [--explain]
                [--from-run RUN [--placement P [--replicas N]] | --imbalance F]
                [--set FIELD=VALUE ...] [--section.key=value ...]

MODEL is a moepar TOML config or a Hugging Face config.json (or its folder); config keys can be
overridden as for `moepar train` (the model, router, dtype, the layout "the config's own layout"
reports on).
"""

import argparse
import dataclasses
import json
import sys
import time

from .activations import RECOMPUTE
from .candidates import Request, config_layout, evaluate, search
from .hardware import FIELDS, PRESETS, resolve_gpu
from .report import assumptions, breakdown, rejected_lines, table, to_json
from .rules import explain
from .source import imbalance_from_run, load_model, placement_imbalance
from .writer import best_runnable, runnable, write_plan

__all__ = ["main", "build_parser", "DEFAULT_IMBALANCE"]

# Dropless routing: the busiest EP rank's routed rows over the mean. An assumption, not a
# measurement (a balanced router keeps it near 1, a fresh or collapsing one far above); a run's
# own value comes from --from-run.
DEFAULT_IMBALANCE = 1.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="moepar plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Rank every valid layout (pp, dp, tp, ep, ZeRO, micro-batch, recompute) of "
                    "MODEL on --gpus GPUs by estimated step time, with memory per GPU.",
        epilog="GPU fields for --set: " + ", ".join(FIELDS) + ". Config keys can be overridden "
               "after MODEL as --section.key=value, as for moepar train.")
    p.add_argument("model", metavar="MODEL", help="moepar TOML config, or a Hugging Face "
                                                  "config.json or model folder")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster (world size)")
    p.add_argument("--gpu", default="h100-80g", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the "
                                                          "config's train.seq_len)")
    p.add_argument("--global-batch-tokens", type=int, default=0,
                   help="tokens per optimizer step (default: the config's global batch)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a GPU field, e.g. --set inter_gbps=25 (repeatable)")
    p.add_argument("--imbalance", type=float, default=None,
                   help=f"dropless load of the busiest EP rank over the mean (default "
                        f"{DEFAULT_IMBALANCE})")
    p.add_argument("--from-run", metavar="RUN", help="take the imbalance from a run directory's "
                                                     "metrics.jsonl (max_load_ratio)")
    p.add_argument("--placement", choices=["contiguous", "balanced"], default=None,
                   help="with --from-run: the busiest EP rank's rows per ep under this expert "
                        "placement of the run's measured load (expert_load.jsonl)")
    p.add_argument("--replicas", type=int, default=0,
                   help="with --placement balanced: replica slots per rank "
                        "(parallel.expert_replicas)")
    p.add_argument("--routing", choices=["config", "dropless", "capacity", "both"],
                   default="config", help="routing to plan for (default: the config's)")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="capacity factor for --routing capacity/both when the config is dropless")
    p.add_argument("--recompute", default="all",
                   help=f"recompute modes to try, from {','.join(RECOMPUTE)} or 'all' (default)")
    p.add_argument("--schedules", default="1f1b,interleaved_1f1b",
                   help="pipeline schedules to try (also gpipe)")
    p.add_argument("--max-bubble", type=float, default=0.25, help="reject layouts whose "
                                                                   "pipeline bubble exceeds this")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="training dtype (default: the config's train.dtype)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--write", metavar="PLAN.toml", help="save the best runnable layout as a run "
                                                        "config for `moepar train`")
    p.add_argument("--explain", action="store_true", help="print the rules the planner applies")
    return p


def _request(args) -> tuple[Request, str, str]:
    base, source = load_model(args.model, args.overrides)
    if args.dtype:
        base = dataclasses.replace(base, train=dataclasses.replace(base.train, dtype=args.dtype))
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise ValueError(f"--gpus {args.gpus} and --gpus-per-node {args.gpus_per_node} must be >= 1")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise ValueError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node "
                         f"{args.gpus_per_node} (every node runs the same number of ranks)")
    overrides = {}
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set {item!r} is not FIELD=VALUE")
        key, value = item.split("=", 1)
        overrides[key.strip()] = value.strip()
    gpu = resolve_gpu(args.gpu, overrides)
    seq_len = args.seq_len or base.train.seq_len
    tokens = args.global_batch_tokens or base.train.global_batch_size * seq_len
    if seq_len < 1 or tokens < 1:
        raise ValueError(f"--seq-len {seq_len} and --global-batch-tokens {tokens} must be >= 1")
    imbalance, why = args.imbalance, "--imbalance"
    if imbalance is None:
        imbalance, why = DEFAULT_IMBALANCE, "default"
    by_ep = None
    if args.placement and not args.from_run:
        raise ValueError("--placement reads the measured load of --from-run RUN: give both")
    if args.replicas < 0 or (args.replicas and args.placement != "balanced"):
        raise ValueError(f"--replicas {args.replicas} needs --placement balanced and must be >= 0")
    if args.from_run and args.placement:
        by_ep, why = placement_imbalance(args.from_run, base.model, args.gpus, args.placement,
                                         args.replicas)
        imbalance = max(by_ep.values())
    elif args.from_run:
        imbalance, why = imbalance_from_run(args.from_run)
    if not imbalance >= 1:
        raise ValueError(f"--imbalance {imbalance} must be >= 1 (busiest over mean)")
    modes = RECOMPUTE if args.recompute == "all" else tuple(
        m.strip() for m in args.recompute.split(",") if m.strip())
    bad = [m for m in modes if m not in RECOMPUTE]
    if bad or not modes:
        raise ValueError(f"--recompute {args.recompute!r}: choose from {', '.join(RECOMPUTE)}")
    schedules = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    bad = [s for s in schedules if s not in ("1f1b", "interleaved_1f1b", "gpipe")]
    if bad or not schedules:
        raise ValueError(f"--schedules {args.schedules!r}: choose from 1f1b, interleaved_1f1b, gpipe")
    routing = ("dropless", "capacity") if args.routing == "both" else (args.routing,)
    req = Request(base, args.gpus, args.gpus_per_node, seq_len, tokens, gpu, imbalance, modes,
                  routing, args.capacity_factor, schedules, args.max_bubble,
                  imbalance_by_ep=by_ep)
    return req, source, why


def _config_layout(req, plans) -> str:
    """Where the config's own layout stands: its rank among the fitting plans, or why not."""
    layout = config_layout(req)
    try:
        own = evaluate(req, layout)
    except ValueError as e:
        return f"the config's own layout ({layout.describe()}) is not valid here: {e}"
    if not own.fits:
        return f"the config's own layout ({layout.describe()}): {own.reason}"
    faster = sum(1 for p in plans if p.fits and p.time["step"] < own.time["step"])
    return (f"the config's own layout ({layout.describe()}, micro-batch {layout.micro_batch}, "
            f"recompute {layout.recompute}): {own.time['step']:.2f} s per step, "
            f"{own.memory['total'] / 2 ** 30:.1f} GiB; {faster} fitting layouts are faster")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.overrides = [a for a in rest if a.startswith("--") and "." in a.split("=", 1)[0]]
    unknown = [a for a in rest if a not in args.overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    started = time.perf_counter()
    try:
        req, source, why = _request(args)
        plans, rejected = search(req)
        best = best_runnable(plans)
        written = None
        if args.write:
            if best is None:
                raise ValueError("no layout fits, nothing to write (see the rejected families)")
            written = write_plan(args.write, req.base, best, req, source)
    except (ValueError, OSError) as e:
        print(f"moepar plan: error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    fitting = [p for p in plans if p.fits]
    if args.json:
        extra = {"model": source, "planned_in_s": seconds, "written": written,
                 "config_layout": _config_layout(req, plans)}
        if args.explain:
            extra["explain"] = explain(req, plans)
        print(json.dumps(to_json(req, plans, rejected, args.top, extra), indent=1))
        return 0
    lines = [f"moepar plan: {source} on {req.world} x {req.gpu.name}, sequences of {req.seq_len}, "
             f"{req.global_tokens:,} tokens per step; {len(plans):,} layouts costed, "
             f"{len(fitting):,} fit, in {seconds:.1f} s"]
    lines += assumptions(req, why)
    lines.append("")
    if fitting:
        lines += table(fitting, args.top)
        lines.append("")
        lines += breakdown(fitting[0])
        if not runnable(fitting[0].layout) and best is not None:
            lines.append(f"#1 needs recompute {fitting[0].layout.recompute!r}, which the trainer "
                         f"does not have yet; --write takes the best runnable one")
    else:
        lines.append("no layout fits")
    lines.append(_config_layout(req, plans))
    if rejected:
        budget = (req.gpu.budget_bytes + req.gpu.overhead_gib * 2 ** 30) / 2 ** 30
        lines += ["", f"rejected families (pp, tp, ep), {len(rejected)}:"]
        lines += rejected_lines(rejected, budget, req.max_bubble)
    if written:
        lines += ["", f"wrote {written}"]
    if args.explain:
        lines += [""] + explain(req, plans)
    print("\n".join(lines))
    return 0
