"""`moepar train`: parse the command line, validate the config, start workers, run the Trainer.

    moepar train CONFIG.toml [--nproc N] [--section.key=value ...]

`--nproc N` validates the config for N ranks, then starts N local workers with torch's own
elastic launcher (what `torchrun` runs); under `torchrun` (or any launcher that sets RANK and
WORLD_SIZE) the process joins the given world instead.
"""

import argparse
import os
import sys

__all__ = ["main", "launch", "end_process_group", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from moepar.config import config_reference
    parser = argparse.ArgumentParser(
        prog="moepar train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model from a TOML config; any config key can be overridden as "
                    "--section.key=value (or --section.key value), after CONFIG.",
        epilog="config keys (section.key = default  # meaning):\n" + config_reference())
    parser.add_argument("config", help="a run config (TOML), e.g. examples/tiny.toml")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="start N local worker processes (torch's elastic launcher); "
                             "ignored under torchrun, which sets the world itself")
    return parser


def _parse(argv: list[str]):
    """(args, overrides) or raises ValueError; argparse handles --help and exits."""
    parser = build_parser()
    if argv and argv[0].startswith("--") and argv[0] not in ("-h", "--help"):
        raise ValueError(f"the config file comes first: moepar train CONFIG.toml [options], "
                         f"got {argv[0]!r} first")
    args, overrides = parser.parse_known_args(argv)
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be a positive integer")
    return args, overrides


def launch(nproc: int, argv: list[str]) -> int:
    """Runs `moepar <argv>` in nproc local workers with torch's elastic launcher (torchrun's).

    The worker's arguments are handed over after parsing, never parsed by the launcher, so a
    worker option that looks like one of the launcher's (`--virtual` vs `--virtual-local-rank`)
    cannot be taken by it.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    args = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}",
                                         "--module", "moepar"])
    args.training_script_args = list(argv)
    try:
        run(args)
    except ChildFailedError as e:
        print(f"moepar: a worker failed:\n{e}", file=sys.stderr)
        return 1
    return 0


def end_process_group(clean: bool = True):
    """Destroys the process group; after a clean run, only once every rank got here (a rank
    tearing its communicators down while a peer still talks aborts that peer)."""
    import torch.distributed as dist
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    from moepar.config import load_config, to_toml
    try:
        args, overrides = _parse(argv)
        cfg = load_config(args.config, overrides)
        from moepar.train import build_dims
        world = int(os.environ.get("WORLD_SIZE", args.nproc))
        build_dims(cfg, world)          # layout errors here, before any process or collective
    except ValueError as e:
        print(f"moepar: config error: {e}", file=sys.stderr)
        return 2
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch(args.nproc, ["train", *argv])
    from moepar.train import NonFiniteError, Trainer
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        print(to_toml(cfg), flush=True)
    clean = False
    try:
        trainer = Trainer(cfg, log=lambda msg: print(msg, flush=True))
        trainer.run()
        clean = True
    except (ValueError, NonFiniteError) as e:
        print(f"moepar: {e}", file=sys.stderr)
        return 1
    finally:
        end_process_group(clean)
    return 0
