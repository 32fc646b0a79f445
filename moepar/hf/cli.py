"""`moepar convert`: Hugging Face folders to moepar checkpoints and back.

    moepar convert --from hf SRC_DIR --to moepar DST_DIR [--dequantize-dtype bfloat16|float32]
    moepar convert --from moepar SRC_DIR --to hf DST_DIR [--arch NAME] [--max-shard-size BYTES]

`--from moepar` takes a checkpoint directory, or a run directory (its newest complete
checkpoint, named in the log). `--to hf` writes the architecture `--arch` names, else the one the
source came from (a converted HF model), else the one architecture the model fits; it guesses
none: a model that fits several, or none, is refused with the choices and the flag.
"""

import argparse
import os
import sys

import torch

from moepar.checkpoint import read_state, verify_listed
from moepar.infer.source import SourceError, resolve_source
from moepar.layers.model import ModelConfig
from moepar.layers.router import RouterConfig

from . import arch
from .arch import ARCHS, ConversionError, arch_problems, load_config_json
from .convert import hf_to_moepar, moepar_to_hf

__all__ = ["main", "build_parser"]

_TAKES_VALUE = {"--from", "--to", "--arch", "--max-shard-size", "--dequantize-dtype"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moepar convert", description="Convert a Hugging Face MoE folder to a moepar "
        "checkpoint (--from hf SRC --to moepar DST) or back (--from moepar SRC --to hf DST). "
        "DST must not exist; nothing is left there on error.")
    parser.add_argument("src", help="the source folder: a HF model, or a moepar checkpoint or run "
                                    "directory (its newest complete checkpoint)")
    parser.add_argument("--from", dest="source", choices=["hf", "moepar"], required=True,
                        help="what SRC is")
    parser.add_argument("--to", dest="target", choices=["hf", "moepar"], required=True,
                        help="what to write at DST")
    parser.add_argument("dst", help="the destination folder (must not exist)")
    parser.add_argument("--arch", choices=sorted(ARCHS),
                        help="HF architecture to write (--to hf; default: the source's, or the "
                             "only one the model's options fit)")
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


def moepar_checkpoint(src: str, log=print) -> str:
    """The checkpoint directory `src` names: itself, or a run directory's newest complete one."""
    try:
        source = resolve_source(src)
    except SourceError as e:
        raise ConversionError(str(e)) from None
    if source.kind == "hf":
        raise ConversionError(f"{src!r} is a Hugging Face folder, not a moepar checkpoint: "
                              "convert it with --from hf")
    if source.kind == "run":
        log(f"converting {source.weights}: the newest complete checkpoint of run {src}")
    return source.weights


def export_arch(ckpt: str, log=print) -> str | None:
    """The architecture to write when --arch is not given: None (the source's own, a converted
    HF model's), or the one architecture the model fits; several or none is an error that names
    the choices and --arch."""
    # The source's config.json, only when the checkpoint lists it (hash-checked) and through
    # the shared loader; an unlisted one is not read (moepar_to_hf says so).
    if verify_listed(ckpt, "hf_config.json"):
        load_config_json(os.path.join(ckpt, "hf_config.json"))   # refuses by name, or a model_type
        return None
    try:
        config = read_state(ckpt)["config"]
        model, router = ModelConfig(**config["model"]), RouterConfig(**config["router"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{ckpt!r}: state.json holds no usable model config ({e})") from None
    fits = arch.matching_archs(model, router)   # looked up on use (tests replace it)
    if len(fits) == 1:
        log(f"architecture {fits[0]}: the only one this model fits (--arch NAME to choose)")
        return fits[0]
    if fits:
        raise ConversionError(f"this model fits several Hugging Face architectures "
                              f"({', '.join(fits)}); choose one with --arch NAME")
    reasons = "\n  ".join(f"{name}: {'; '.join(arch_problems(arch, model, router))}"
                          for name, arch in ARCHS.items())
    raise ConversionError("this model fits no Hugging Face architecture, and --arch was not "
                          f"given; the choices for --arch NAME, and what each needs:\n  {reasons}")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(_positionals_last(argv))
    if args.source == args.target:
        parser.error("--from and --to must differ")
    try:
        if args.source == "hf":
            out = hf_to_moepar(args.src, args.dst, args.max_shard_size,
                               getattr(torch, args.dequantize_dtype))
        else:
            ckpt = moepar_checkpoint(args.src)
            arch = args.arch or export_arch(ckpt)
            out = moepar_to_hf(ckpt, args.dst, arch, args.max_shard_size)
    except (ConversionError, ValueError) as e:
        print(f"moepar: conversion error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
