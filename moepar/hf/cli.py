"""`moepar convert`: Hugging Face folders to moepar checkpoints and back.

    moepar convert --from hf SRC_DIR --to moepar DST_DIR [--dequantize-dtype bfloat16|float32]
    moepar convert --from moepar SRC_DIR --to hf DST_DIR [--arch NAME] [--max-shard-size BYTES]
"""

import argparse
import sys

__all__ = ["main", "build_parser"]

_TAKES_VALUE = {"--from", "--to", "--arch", "--max-shard-size", "--dequantize-dtype"}


def build_parser() -> argparse.ArgumentParser:
    from .arch import ARCHS
    parser = argparse.ArgumentParser(
        prog="moepar convert", description="Convert a Hugging Face MoE folder to a moepar "
        "checkpoint (--from hf SRC --to moepar DST) or back (--from moepar SRC --to hf DST). "
        "DST must not exist; nothing is left there on error.")
    parser.add_argument("src", help="the source folder (HF model, or moepar checkpoint step)")
    parser.add_argument("--from", dest="source", choices=["hf", "moepar"], required=True,
                        help="what SRC is")
    parser.add_argument("--to", dest="target", choices=["hf", "moepar"], required=True,
                        help="what to write at DST")
    parser.add_argument("dst", help="the destination folder (must not exist)")
    parser.add_argument("--arch", choices=sorted(ARCHS),
                        help="HF architecture to write (--to hf; default: the source's, or the "
                             "one the model's options match)")
    parser.add_argument("--max-shard-size", type=int, default=2 << 30, metavar="BYTES",
                        help="bytes per output safetensors shard (default 2 GiB)")
    parser.add_argument("--dequantize-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="--from hf with FP8 block-quantized weights (DeepSeek-V3's "
                             "weight_scale_inv): the dtype they are dequantized to (default "
                             "bfloat16, as DeepSeek's own fp8_cast_bf16)")
    return parser


def _positionals_last(argv: list[str]) -> list[str]:
    """'--from hf A --to moepar B' -> '--from hf --to moepar A B' (argparse wants them apart)."""
    flags, positionals, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in _TAKES_VALUE and i + 1 < len(argv):
            flags += [arg, argv[i + 1]]
            i += 2
            # the source/destination path directly after --from X / --to Y
            if arg in ("--from", "--to") and i < len(argv) and not argv[i].startswith("-"):
                positionals.append(argv[i])
                i += 1
            continue
        (flags if arg.startswith("-") else positionals).append(arg)
        i += 1
    return flags + positionals


def main(argv: list[str]) -> int:
    from .arch import ConversionError
    from .convert import hf_to_moepar, moepar_to_hf
    parser = build_parser()
    args = parser.parse_args(_positionals_last(argv))
    if args.source == args.target:
        parser.error("--from and --to must differ")
    try:
        if args.source == "hf":
            import torch
            out = hf_to_moepar(args.src, args.dst, args.max_shard_size,
                               getattr(torch, args.dequantize_dtype))
        else:
            out = moepar_to_hf(args.src, args.dst, args.arch, args.max_shard_size)
    except (ConversionError, ValueError) as e:
        print(f"moepar: conversion error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
