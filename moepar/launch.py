"""`moepar train`: parse the command line, validate the config, start workers, run the Trainer.

    moepar train CONFIG.toml [--nproc N] [--section.key=value ...]

`--nproc N` validates the config for N ranks, then starts N local workers with torch's own
elastic launcher (what `torchrun` runs); under `torchrun` (or any launcher that sets RANK and
WORLD_SIZE) the process joins the given world instead.
"""

import argparse
import os
import sys

__all__ = ["main", "launch", "end_process_group", "build_parser", "select_device",
           "device_index", "init_process_group"]


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


def device_index(env, cuda_count: int) -> int:
    """The CUDA device of this process (pure): LOCAL_RANK when the launcher sets it (torchrun),
    else RANK modulo the devices on this node (launchers such as SLURM's srun set only RANK and
    WORLD_SIZE; every rank taking cuda:0 would make NCCL fail with "Duplicate GPU detected")."""
    if "LOCAL_RANK" in env:
        index = int(env["LOCAL_RANK"])
        if index >= cuda_count:
            raise ValueError(f"LOCAL_RANK={index} but this node has {cuda_count} CUDA device(s): "
                             "start at most that many processes per node")
        return index
    return int(env.get("RANK", 0)) % cuda_count


def select_device(want: str, backend: str = "auto", env=None, cuda_count: int | None = None):
    """The device for train.device (auto, cpu, cuda) on this process; refuses a backend that
    cannot carry that device's tensors (before any process group exists)."""
    import torch
    env = os.environ if env is None else env
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if want == "cpu" or (want == "auto" and cuda_count == 0):
        device = torch.device("cpu")
    elif cuda_count == 0:
        raise ValueError("train.device='cuda' but CUDA is not available")
    else:
        device = torch.device("cuda", device_index(env, cuda_count))
    if backend == "gloo" and device.type == "cuda":
        raise ValueError(f"parallel.backend='gloo' with train.device={want!r} on a CUDA host "
                         f"(device {device}): gloo's all-to-all carries CPU tensors only; use "
                         "parallel.backend='nccl' (or auto), or train.device='cpu'")
    if backend == "nccl" and device.type == "cpu":
        raise ValueError(f"parallel.backend='nccl' with train.device={want!r} resolving to the "
                         "CPU: NCCL needs CUDA tensors; use parallel.backend='gloo' (or auto)")
    return device


def init_process_group(parallel, device, world_size: int):
    """Sets this process's CUDA device (always, also when a process group exists) and joins the
    launcher's world when there is more than one rank, with `parallel.timeout_s` for every
    collective and `device_id` so NCCL barriers and object collectives use the right GPU."""
    import datetime

    import torch
    import torch.distributed as dist
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1 or dist.is_initialized():
        return
    backend = parallel.backend if parallel.backend != "auto" else (
        "nccl" if device.type == "cuda" else "gloo")
    kwargs = {"timeout": datetime.timedelta(seconds=parallel.timeout_s)}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, **kwargs)


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
