"""The `moepar` command: `moepar train CONFIG.toml [--section.key=value ...]`, `moepar bench ...`."""

import argparse
import sys

__all__ = ["main"]

USAGE = """moepar train CONFIG.toml [--section.key=value ...]
       moepar bench moe-layer [--tokens N --dim D --ffn-dim F --experts E --top-k K --dtype T] [--json]"""


def _train(argv: list[str]) -> int:
    from moepar.config import load_config, to_toml
    if not argv or argv[0].startswith("--"):
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv[0], argv[1:])
    except ValueError as e:
        print(f"moepar: config error: {e}", file=sys.stderr)
        return 2
    from moepar.train import NonFiniteError, Trainer
    print(to_toml(cfg), flush=True)
    try:
        trainer = Trainer(cfg, log=lambda msg: print(msg, flush=True))
        trainer.run()
    except (ValueError, NonFiniteError) as e:
        print(f"moepar: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return _train(rest)
    if command == "bench":
        from moepar.bench import main as bench_main
        return bench_main(rest)
    print(f"moepar: unknown command {command!r}\nusage: {USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
