"""`moepar eval`: validation loss and perplexity of a run or checkpoint, computed as training's
validation does (moepar/validation.py: the batches, their split over dp ranks, val_loss, val_ppl).

    moepar eval RUN_OR_CHECKPOINT --data DIR [--batches N] [--nproc N] [--section.key=value ...]

`moepar eval` reads the run's config.toml (beside the run's checkpoints, or the converted
checkpoint's own), points [data] at --data, loads the checkpoint into the layout of [parallel]
when it fits --nproc (else plain data parallelism), and prints one JSON line.
"""

import argparse
import json
import os
import sys

from moepar.build import build_dims, build_engine
from moepar.checkpoint import load_checkpoint, read_state
from moepar.config import load_config
from moepar.infer.source import resolve_source
from moepar.launch import launch
from moepar.process import end_process_group, init_process_group, select_device
from moepar.validation import Validation

__all__ = ["main", "evaluate_checkpoint"]

# ---- the command ------------------------------------------------------------------------------

_LAYOUT_KEYS = ("dp", "tp", "pp", "ep", "pp_virtual", "pp_layers", "pp_schedule")
_DATA_PARALLEL = ["--parallel.dp=0", "--parallel.tp=1", "--parallel.pp=1", "--parallel.ep=1",
                  "--parallel.pp_virtual=1", "--parallel.pp_layers=", "--parallel.pp_schedule=1f1b"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="moepar eval", description="Validation loss and perplexity of a checkpoint on the "
        "val split of a prepared folder; config keys may be overridden as --section.key=value "
        "(e.g. --train.seq_len=2048 --train.micro_batch_size=4).")
    parser.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint "
                                       "directory")
    parser.add_argument("--data", required=True, metavar="DIR",
                        help="a folder from `moepar data prepare` (its val split is read)")
    parser.add_argument("--batches", type=int, metavar="N",
                        help="global batches to evaluate (default: the run's train.eval_batches)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="local worker processes (ignored under torchrun)")
    return parser


def _config_file(source) -> str:
    for folder in (source.weights, source.run_dir):
        if folder and os.path.isfile(os.path.join(folder, "config.toml")):
            return os.path.join(folder, "config.toml")
    raise ValueError(f"no config.toml beside checkpoint {source.weights!r} or in its run "
                     "directory")


def _resolve(args, overrides: list[str], world: int, log):
    """(source, config, dims), the layout falling back to data parallelism when the run's does
    not fit `world` ranks (and no --parallel.* layout key was given)."""
    source = resolve_source(args.source)
    if source.kind == "hf":
        raise ValueError(f"{args.source!r} is a Hugging Face folder; convert it first: moepar "
                         f"convert --from hf {args.source} --to moepar DIR")
    forced = [f"--data.path={args.data}", "--data.source=tokens", "--data.paths=",
              "--data.weights=", "--run.resume=false", "--run.resume_from=", "--run.init_from=",
              "--train.eval_every=0"]
    if args.batches is not None:
        forced.append(f"--train.eval_batches={args.batches}")
    path = _config_file(source)
    cfg = load_config(path, [*overrides, *forced])
    try:
        return source, cfg, build_dims(cfg, world)
    except ValueError as e:
        if any(o.lstrip("-").split("=")[0] in {f"parallel.{k}" for k in _LAYOUT_KEYS}
               for o in overrides):
            raise
        log(f"note: the run's layout does not fit {world} process(es) ({e}); evaluating with "
            "data parallelism")
    cfg = load_config(path, [*overrides, *_DATA_PARALLEL, *forced])
    return source, cfg, build_dims(cfg, world)


def evaluate_checkpoint(cfg, dims, weights: str) -> dict:
    """This process's part of `moepar eval` (every rank): the checkpoint's validation figures."""
    rank = int(os.environ.get("RANK", 0))
    validation = Validation(cfg, dims, rank)      # data errors before any process group
    device = select_device(cfg.train.device, cfg.parallel.backend)
    init_process_group(cfg.parallel, device, dims.world_size)
    num_local = cfg.train.global_batch_size // cfg.train.micro_batch_size // dims.dp
    engine = build_engine(cfg, dims.bind(rank, device), device, num_local)
    load_checkpoint(weights, engine, restore_rng=False)
    t = cfg.train
    return {"checkpoint": weights, "step": read_state(weights).get("step"),
            **validation.run(engine), "micro_batches": validation.num_micro,
            "tokens": validation.num_micro * t.micro_batch_size * t.seq_len,
            "layout": dims.describe()}


def main(argv: list[str]) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    rank = int(os.environ.get("RANK", 0))
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc {args.nproc} must be a positive integer")
        source, cfg, dims = _resolve(args, overrides, world, log)
    except ValueError as e:
        print(f"moepar eval: error: {e}", file=sys.stderr)
        return 2
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch(args.nproc, ["eval", *argv])
    clean = False
    try:
        result = evaluate_checkpoint(cfg, dims, source.weights)
        clean = True
    except ValueError as e:
        print(f"moepar eval: error: {e}", file=sys.stderr)
        return 1
    finally:
        end_process_group(clean)
    if rank == 0:
        print(json.dumps(result), flush=True)
    return 0
