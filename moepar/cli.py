"""The `moepar` command: `moepar train CONFIG.toml [--section.key=value ...]`, `moepar bench ...`."""

import ctypes
import os
import sys

__all__ = ["main"]

USAGE = """moepar train CONFIG.toml [--nproc N] [--section.key=value ...]
       moepar bench moe-layer [--tokens N --dim D --ffn-dim F --experts E --top-k K --dtype T] [--ep N] [--json]
       moepar convert --from hf SRC_DIR --to moepar DST_DIR
       moepar convert --from moepar SRC_DIR --to hf DST_DIR [--arch mixtral|qwen2_moe|qwen3_moe|olmoe|deepseek_v3]
       moepar bench dispatch --ep N [--tokens N --dim D --experts E --top-k K --dtype T] [--json]"""


def _pop_nproc(argv: list[str]) -> tuple[int, list[str]]:
    """Removes `--nproc N` / `--nproc=N` from argv; returns (N or 1, the rest)."""
    rest, nproc, i = [], 1, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc" or arg.startswith("--nproc="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--nproc {value!r} must be a positive integer")
            nproc = int(value)
            continue
        rest.append(arg)
        i += 1
    return nproc, rest


def launch(nproc: int, argv: list[str]) -> int:
    """Runs `moepar <argv>` in nproc local workers with torch's elastic launcher (torchrun's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    args = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}",
                                         "--module", "moepar", *argv])
    try:
        run(args)
    except ChildFailedError as e:
        print(f"moepar: a worker failed:\n{e}", file=sys.stderr)
        return 1
    return 0


def _train(argv: list[str]) -> int:
    from moepar.config import load_config, to_toml
    try:
        nproc, argv = _pop_nproc(argv)
        if not argv or argv[0].startswith("--"):
            print(f"usage: {USAGE}", file=sys.stderr)
            return 2
        cfg = load_config(argv[0], argv[1:])
        from moepar.train import build_dims
        world = int(os.environ.get("WORLD_SIZE", nproc))
        build_dims(cfg, world)          # layout errors here, before any process or collective
    except ValueError as e:
        print(f"moepar: config error: {e}", file=sys.stderr)
        return 2
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch(nproc, ["train", *argv])
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


def end_process_group(clean: bool = True):
    """Destroys the process group; after a clean run, only once every rank got here (a rank
    tearing its communicators down while a peer still talks aborts that peer)."""
    import torch.distributed as dist
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def _convert(argv: list[str]) -> int:
    import argparse
    from moepar.hf import ARCHS, ConversionError, hf_to_moepar, moepar_to_hf
    parser = argparse.ArgumentParser(prog="moepar convert")
    parser.add_argument("src")
    parser.add_argument("--from", dest="source", choices=["hf", "moepar"], required=True)
    parser.add_argument("--to", dest="target", choices=["hf", "moepar"], required=True)
    parser.add_argument("dst")
    parser.add_argument("--arch", choices=sorted(ARCHS), help="HF architecture to write (--to hf)")
    parser.add_argument("--max-shard-size", type=int, default=2 << 30, help="bytes per output shard")
    args = parser.parse_args(_positionals_last(argv))
    if args.source == args.target:
        parser.error("--from and --to must differ")
    try:
        if args.source == "hf":
            out = hf_to_moepar(args.src, args.dst, args.max_shard_size)
        else:
            out = moepar_to_hf(args.src, args.dst, args.arch, args.max_shard_size)
    except (ConversionError, ValueError) as e:
        print(f"moepar: conversion error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _positionals_last(argv: list[str]) -> list[str]:
    """'--from hf A --to moepar B' -> '--from hf --to moepar A B' (argparse wants them apart)."""
    flags, positionals, i = [], [], 0
    takes_value = {"--from", "--to", "--arch", "--max-shard-size"}
    while i < len(argv):
        arg = argv[i]
        if arg in takes_value and i + 1 < len(argv):
            flags += [arg, argv[i + 1]]
            i += 2
            # the source/destination path directly after --from X / --to Y
            if arg in ("--from", "--to") and i < len(argv) and not argv[i].startswith("--"):
                positionals.append(argv[i])
                i += 1
            continue
        (flags if arg.startswith("--") else positionals).append(arg)
        i += 1
    return flags + positionals


def tune_cpu_allocator() -> bool:
    """Keeps freed memory in the process heap (glibc only; MOEPAR_MALLOC_TUNING=0 turns it off).

    By default glibc returns every allocation over 32 MiB to the kernel on free, so each training
    step page-faults its largest activations back in: measured here at 45-68k faults and 75-124 ms
    of kernel time per forward+backward of the benchmark MoE layer (~500 ms). With mmap off and
    trimming at 1 GiB, a steady-state step reuses its memory and faults ~0 times. A training loop
    allocates the same shapes every step, so the heap does not grow past the first step's peak.
    """
    if os.environ.get("MOEPAR_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc
        return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tune_cpu_allocator()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return _train(rest)
    if command == "convert":
        return _convert(rest)
    if command == "bench":
        from moepar.bench import main as bench_main
        return bench_main(rest)
    print(f"moepar: unknown command {command!r}\nusage: {USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
