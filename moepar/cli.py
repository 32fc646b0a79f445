"""The `moepar` command: parses the command name and hands the rest to that command's module.

    moepar train CONFIG.toml [--nproc N] [--section.key=value ...]
    moepar convert --from hf|moepar SRC --to moepar|hf DST [--arch NAME]
    moepar bench moe-layer|dispatch|memory|pipeline|checkpoint|train|traffic|optimizer [options]

Every command has `--help`. This file only dispatches; each command parses its own arguments.
"""

import ctypes
import importlib
import os
import sys

from moepar import __version__

__all__ = ["main", "COMMANDS"]

# name -> (module with main(argv) -> int, one line of help)
COMMANDS = {
    "train": ("moepar.launch", "train a model from a TOML config, on one or many processes"),
    "convert": ("moepar.hf.cli", "convert Hugging Face checkpoints to moepar and back"),
    "data": ("moepar.data.cli", "tokenize text into a prepared folder: moepar data prepare ..."),
    "inspect": ("moepar.inspect", "a run's expert load: hot, cold, dead experts, drops, plots"),
    "plan": ("moepar.plan.cli", "choose a layout for a model on N GPUs: memory and step time"),
    "eval": ("moepar.infer.evaluate", "validation loss and perplexity of a run or checkpoint"),
    "generate": ("moepar.infer.generate", "continue a prompt: a run, checkpoint or HF folder"),
    "bench": ("moepar.bench", "benchmarks: moe-layer, dispatch, memory, pipeline, checkpoint, train, traffic, optimizer"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: moepar COMMAND [options]   (moepar COMMAND --help for its options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "  --version  print the version"]
    return "\n".join(lines)


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
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"moepar {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"moepar: unknown command {command!r}\n{usage()}", file=sys.stderr)
        return 2
    tune_cpu_allocator()
    return importlib.import_module(COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
