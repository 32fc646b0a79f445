"""`moepar data`: tokenized datasets.

    moepar data prepare --tokenizer TOKENIZER | --train-tokenizer VOCAB --input FILE... --out DIR
                        [--text-field text] [--val-fraction 0.005] [--val-tokens 2049] [--seed 0]
                        [--workers N] [--split-blank-lines] [--eos-token TOKEN]
                        [--shard-tokens N] [--overwrite]
"""

import argparse
import os
import sys

from moepar.data.prepare import PrepareOptions, prepare
from moepar.data.split import default_val_tokens

__all__ = ["main", "build_parser"]


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:     # not Linux
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moepar data", description="Tokenized datasets.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = commands.add_parser(
        "prepare", prog="moepar data prepare",
        help="tokenize .txt / .jsonl(.gz) files into shards for data.source='tokens'",
        description="Tokenize documents into uint16/uint32 .npy shards with an index.json, and "
                    "hold out whole documents as a validation split. Train on the result with "
                    "--data.source=tokens --data.path=DIR. Nothing is left at --out on error.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", metavar="TOKENIZER",
                       help="a Hugging Face tokenizer.json, a model folder holding one, or 'bytes' "
                            "(moepar's byte tokenizer: vocabulary 256, EOS id 255)")
    which.add_argument("--train-tokenizer", type=int, default=0, metavar="VOCAB",
                       help="train a byte-level BPE of VOCAB tokens (EOS <|endoftext|>) on the "
                            "training split only, and write it into the folder as tokenizer.json")
    p.add_argument("--input", dest="inputs", nargs="+", action="extend", required=True,
                   metavar="FILE", help=".txt (one document per file), .jsonl or .jsonl.gz (one "
                   "JSON object per line); .txt.gz too")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not "
                   "exist, unless --overwrite and it is a prepared folder)")
    p.add_argument("--text-field", default="text", metavar="FIELD", help="the JSON field holding a document's "
                   "text (default: text)")
    p.add_argument("--val-fraction", type=float, default=0.005, metavar="F", help="share of documents held "
                   "out for validation (default 0.005; 0: none)")
    p.add_argument("--val-tokens", type=int, default=default_val_tokens(), metavar="N",
                   help="hold out at least N tokens (default %(default)s: what the default "
                        "evaluation reads); when --val-fraction's documents hold fewer, more are "
                        "held out, lowest hash first; 0: the fraction alone")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="keys the hash that picks the held-out documents (default 0)")
    p.add_argument("--workers", type=int, default=_default_workers(), metavar="N",
                   help="tokenizer processes (default: the usable CPUs, here %(default)s)")
    p.add_argument("--split-blank-lines", action="store_true",
                   help=".txt inputs: every paragraph (text between blank lines) is a document")
    p.add_argument("--eos-token", metavar="TOKEN", help="the token that ends every document "
                   "(default: the tokenizer's own EOS, from tokenizer_config.json, config.json, "
                   "the post-processor or its special tokens)")
    p.add_argument("--shard-tokens", type=int, default=1 << 26, metavar="N",
                   help="tokens per shard file (default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared --out")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    opts = PrepareOptions(
        tokenizer=args.tokenizer, inputs=args.inputs, out=args.out, text_field=args.text_field,
        val_fraction=args.val_fraction, seed=args.seed, workers=args.workers,
        split_blank_lines=args.split_blank_lines, eos_token=args.eos_token,
        shard_tokens=args.shard_tokens, overwrite=args.overwrite, val_tokens=args.val_tokens,
        train_tokenizer=args.train_tokenizer)
    try:
        index = prepare(opts)
    except ValueError as e:      # PrepareError and the tokenizer's errors name file and line
        print(f"moepar data prepare: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moepar data prepare: interrupted; nothing was written", file=sys.stderr)
        return 130
    tok, splits = index["tokenizer"], index["splits"]
    print(f"wrote {args.out}: " + ", ".join(
        f"{name} {s['num_tokens']:,} tokens ({s['num_documents']:,} documents, "
        f"{len(s['shards'])} shard(s))" for name, s in splits.items())
        + f"; {index['dtype']}, vocabulary {tok['vocab_size']:,}, EOS {tok['eos_token']!r} = "
        f"id {tok['eos_id']} (from {tok['eos_from']})")
    print(f"train on it: moepar train CONFIG.toml --data.source=tokens --data.path={args.out} "
          f"--model.vocab_size={tok['vocab_size']} (or larger)")
    return 0
