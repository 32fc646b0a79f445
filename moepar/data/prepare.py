"""`moepar data prepare`: .txt and .jsonl(.gz) documents, tokenized by parallel worker processes,
written as uint16/uint32 .npy shards plus a JSON index, with a held-out validation split.

The main process reads each input as raw blocks of lines (~1 MiB, cut at line ends, or at blank
lines with --split-blank-lines, so no document straddles two blocks). Workers decode, parse,
tokenize, append EOS to every document and pick each document's split; their results come back
in input order, so the output does not depend on --workers. Everything is written into a
temporary folder beside --out and renamed at the end: a failure leaves nothing at --out.

A document goes to `val` when blake2b-64(seed, its UTF-8 text) / 2^64 < val_fraction: whole
documents, the same split for the same text whatever the input order, duplicates together. When
those hold fewer than `val_tokens` tokens, the threshold is raised and the input tokenized again
(moepar/data/split.py). `--train-tokenizer VOCAB` first trains a byte-level BPE on the training
split alone (moepar/data/bpe.py), so no validation document shapes the vocabulary.
"""

import collections
import dataclasses
import gzip
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import zlib

import numpy as np

from moepar import __version__
from moepar.data.bpe import train_bpe
from moepar.data.documents import write_document_ends
from moepar.data.folder import FORMAT, INDEX, VERSION, is_prepared
from moepar.data.split import Reserve, doc_hash, raised_threshold, seed_key
from moepar.data.tokenizer import TokenizerSpec, load_encoder, resolve_tokenizer

__all__ = ["PrepareOptions", "PrepareError", "prepare", "SUFFIXES"]

SUFFIXES = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".txt": "txt", ".txt.gz": "txt"}
PARAGRAPH_BREAK = re.compile(r"\r?\n(?:[ \t\r\f\v]*\n)+")   # one or more blank lines


class PrepareError(ValueError):
    """Bad input or output: the message names the file (and line)."""


@dataclasses.dataclass
class PrepareOptions:
    tokenizer: str | None             # None with train_tokenizer
    inputs: list[str]
    out: str
    text_field: str = "text"
    val_fraction: float = 0.005
    seed: int = 0
    workers: int = 1
    split_blank_lines: bool = False
    eos_token: str | None = None
    shard_tokens: int = 1 << 26       # 128 MiB (uint16) or 256 MiB (uint32) per shard
    overwrite: bool = False
    val_tokens: int = 0               # at least this many validation tokens (the CLI's default:
                                      # split.default_val_tokens()); 0: the fraction alone
    train_tokenizer: int = 0          # > 0: train a byte-level BPE of this vocabulary instead
    block_bytes: int = 1 << 20        # input bytes per worker task

    def check(self):
        if not self.inputs:
            raise PrepareError("--input: give at least one file")
        if not 0 <= self.val_fraction < 1:
            raise PrepareError(f"--val-fraction {self.val_fraction} must be in [0, 1)")
        if bool(self.tokenizer) == bool(self.train_tokenizer):
            raise PrepareError("give either --tokenizer or --train-tokenizer VOCAB")
        if self.val_tokens < 0:
            raise PrepareError(f"--val-tokens {self.val_tokens} must be >= 0")
        if self.train_tokenizer and self.train_tokenizer < 257:
            raise PrepareError(f"--train-tokenizer {self.train_tokenizer}: a byte-level BPE needs "
                               "a vocabulary of at least 257 (256 bytes and the EOS token)")
        for name in ("workers", "shard_tokens", "block_bytes"):
            if getattr(self, name) < 1:
                raise PrepareError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        seen = set()
        for path in self.inputs:
            input_kind(path)
            if not os.path.isfile(path):
                raise PrepareError(f"{path}: no such file")
            if os.path.getsize(path) == 0:
                raise PrepareError(f"{path}: empty input (0 bytes)")
            if os.path.realpath(path) in seen:
                raise PrepareError(f"{path}: given twice in --input")
            seen.add(os.path.realpath(path))
        if os.path.exists(self.out):
            if not self.overwrite:
                raise PrepareError(f"--out {self.out} already exists; pass --overwrite to replace "
                                   "it, or choose another folder")
            if not (is_prepared(self.out) or (os.path.isdir(self.out) and not os.listdir(self.out))):
                raise PrepareError(f"--out {self.out} exists and is not a prepared folder (no "
                                   f"{INDEX}); --overwrite replaces only those, delete it yourself")


def input_kind(path: str) -> str:
    for suffix, kind in SUFFIXES.items():
        if path.endswith(suffix):
            return kind
    raise PrepareError(f"{path}: unknown input type; expected one of {', '.join(SUFFIXES)}")


@dataclasses.dataclass
class Block:
    file: int            # index into the inputs
    path: str
    first_line: int      # 1-based number of the block's first line
    data: bytes
    raw_bytes: int       # bytes of the input file (compressed, for .gz) this block consumed


def _read_blocks(inputs: list[str], opts: PrepareOptions):
    """Blocks of whole lines (whole paragraphs with --split-blank-lines; whole files for plain
    .txt), in input order."""
    for file, path in enumerate(inputs):
        kind, line = input_kind(path), 1
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            last_pos, lines, size, after_blank = 0, [], 0, False
            try:
                if kind == "txt" and not opts.split_blank_lines:
                    yield Block(file, path, 1, stream.read(), os.path.getsize(path))
                    continue
                for text in stream:
                    # Paragraph blocks end with their blank lines and start at a text line, so
                    # splitting a block splits the file the same way.
                    if kind == "txt" and size >= opts.block_bytes and after_blank and text.strip():
                        yield Block(file, path, line, b"".join(lines), raw.tell() - last_pos)
                        line, last_pos, lines, size = line + len(lines), raw.tell(), [], 0
                    lines.append(text)
                    size += len(text)
                    after_blank = not text.strip()
                    if kind == "jsonl" and size >= opts.block_bytes:
                        yield Block(file, path, line, b"".join(lines), raw.tell() - last_pos)
                        line, last_pos, lines, size = line + len(lines), raw.tell(), [], 0
            except (OSError, EOFError, zlib.error) as e:
                raise PrepareError(f"{path}: cannot read past line {line + len(lines)}: {e}") \
                    from None
            if lines:
                yield Block(file, path, line, b"".join(lines), os.path.getsize(path) - last_pos)


def _decode(data: bytes, path: str, first_line: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise PrepareError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column "
                           f"{column}: {e.reason})") from None


def _jsonl_documents(block: Block, field: str) -> list[str]:
    docs = []
    for i, raw in enumerate(block.data.split(b"\n")):
        if not raw.strip():
            continue
        line = block.first_line + i
        text = _decode(raw, block.path, line)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise PrepareError(f"{block.path}:{line}: invalid JSON ({e.msg} at column "
                               f"{e.colno})") from None
        if not isinstance(obj, dict):
            raise PrepareError(f"{block.path}:{line}: a JSON {type(obj).__name__}, not an object "
                               f"with a '{field}' field")
        if field not in obj:
            keys = ", ".join(map(repr, list(obj)[:8])) or "none"
            raise PrepareError(f"{block.path}:{line}: no '{field}' field (keys: {keys}); choose "
                               "the field with --text-field")
        if not isinstance(obj[field], str):
            raise PrepareError(f"{block.path}:{line}: field '{field}' is a "
                               f"{type(obj[field]).__name__}, not a string")
        docs.append(obj[field])
    return docs


@dataclasses.dataclass
class Tokenized:
    file: int
    train: np.ndarray       # this block's training documents, each followed by EOS
    val: np.ndarray
    train_docs: int
    val_docs: int
    empty_docs: int         # JSON lines skipped for an empty text
    raw_bytes: int
    train_keys: list        # (hash, tokens with EOS) of each training document
    lengths: dict           # split -> int64 tokens (with EOS) of each of its documents


class BlockTokenizer:
    """The worker's job: one Block in, its documents tokenized and split. The tokenizer is built
    on first use, inside the process that uses it."""

    def __init__(self, spec: TokenizerSpec | None, opts: PrepareOptions, threshold: float):
        self.spec, self.field, self.paragraphs = spec, opts.text_field, opts.split_blank_lines
        self.threshold, self.key = threshold, seed_key(opts.seed)
        self.encode = None

    def documents(self, block: Block) -> list[str]:
        if input_kind(block.path) == "jsonl":
            return _jsonl_documents(block, self.field)
        text = _decode(block.data, block.path, block.first_line)
        if self.paragraphs:   # paragraphs without their surrounding line breaks
            return [p.strip("\r\n") for p in PARAGRAPH_BREAK.split(text)]
        return [text]

    def __call__(self, block: Block) -> Tokenized:
        if self.encode is None:
            self.encode = load_encoder(self.spec)
        docs = self.documents(block)
        kept = [d for d in docs if d.strip()]
        # Blank "paragraphs" are not documents; a JSON line with an empty text is a skipped one.
        empty = len(docs) - len(kept) if input_kind(block.path) == "jsonl" else 0
        hashes = [doc_hash(d, self.key) for d in kept]
        is_val = [h < self.threshold for h in hashes]
        eos = np.array([self.spec.eos_id], dtype=self.spec.dtype)
        parts, train_keys, lengths = {False: [], True: []}, [], {False: [], True: []}
        for ids, val, h in zip(self.encode(kept), is_val, hashes, strict=True):
            parts[val] += [ids, eos]
            lengths[val].append(len(ids) + 1)
            if not val:
                train_keys.append((h, len(ids) + 1))
        joined = {k: np.concatenate(v) if v else np.zeros(0, self.spec.dtype)
                  for k, v in parts.items()}
        n_val = sum(is_val)
        return Tokenized(block.file, joined[False], joined[True], len(kept) - n_val, n_val,
                         empty, block.raw_bytes, train_keys,
                         {"train": np.array(lengths[False], np.int64),
                          "val": np.array(lengths[True], np.int64)})


_JOB: BlockTokenizer | None = None    # each worker process's own job (multiprocessing idiom)


def _init_worker(job: BlockTokenizer):
    global _JOB
    # One tokenizer thread per worker: the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _JOB = job


def _run_job(block: Block) -> Tokenized:
    return _JOB(block)


def _ordered_results(job: BlockTokenizer, blocks, workers: int):
    """job(block) for every block, in order; at most 2 * workers blocks in flight."""
    if workers == 1:
        yield from map(job, blocks)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(job,)) as pool:
        pending = collections.deque()
        for block in blocks:
            pending.append(pool.apply_async(_run_job, (block,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _HashingFile:
    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data):
        self.sha256.update(data)
        return self.f.write(data)


class ShardWriter:
    """One split's tokens cut into .npy shards of exactly shard_tokens (the last one shorter);
    readers concatenate the shards, so documents may straddle a cut."""

    def __init__(self, folder: str, split: str, dtype: str, shard_tokens: int):
        self.folder, self.split, self.shards = folder, split, []
        self.buf = np.empty(shard_tokens, dtype=dtype)     # pages are touched only as filled
        self.fill = 0
        self.lengths = []     # each block's document lengths (documents.py writes their ends)

    def add(self, ids: np.ndarray, lengths: np.ndarray | None = None):
        if lengths is not None:
            self.lengths.append(lengths)
        while len(ids):
            take = min(len(self.buf) - self.fill, len(ids))
            self.buf[self.fill:self.fill + take] = ids[:take]
            self.fill, ids = self.fill + take, ids[take:]
            if self.fill == len(self.buf):
                self.flush()

    def flush(self):
        if not self.fill:
            return
        name = f"{self.split}-{len(self.shards):05d}.npy"
        with open(os.path.join(self.folder, name), "wb") as f:
            hashing = _HashingFile(f)
            np.save(hashing, self.buf[:self.fill])
        self.shards.append({"file": name, "num_tokens": self.fill,
                            "sha256": hashing.sha256.hexdigest()})
        self.fill = 0

    def summary(self, docs: int) -> dict:
        self.flush()
        return {"num_tokens": sum(s["num_tokens"] for s in self.shards), "num_documents": docs,
                "shards": self.shards,
                "documents": write_document_ends(self.folder, self.split, self.lengths)}


class Progress:
    """A plain-text progress line on stderr: redrawn in place on a terminal, else one line every
    10 s (CI logs)."""

    def __init__(self, total_bytes: int, stream=sys.stderr):
        self.total, self.stream, self.start = max(total_bytes, 1), stream, time.perf_counter()
        self.tty = stream.isatty()
        self.every, self.last = (0.2 if self.tty else 10.0), 0.0

    def update(self, done: int, docs: int, tokens: int, final: bool = False):
        now = time.perf_counter()
        if not final and now - self.last < self.every:
            return
        self.last, elapsed = now, max(now - self.start, 1e-9)
        text = (f"prepare: {100 * min(done / self.total, 1):5.1f}% | {done / 1e6:,.1f}/"
                f"{self.total / 1e6:,.1f} MB | {docs:,} docs | {tokens:,} tokens | "
                f"{tokens / elapsed / 1e6:.2f}M tok/s")
        self.stream.write(("\r" + text + ("\n" if final else "")) if self.tty else text + "\n")
        self.stream.flush()


class _MoreValidation(Exception):
    """The split held too few validation tokens: tokenize again with this threshold."""

    def __init__(self, threshold: int, moved: int):
        super().__init__(threshold, moved)
        self.threshold, self.moved = threshold, moved


# Tries of --train-tokenizer: each raise of the threshold retrains on the smaller training split
# (a new vocabulary may count the documents differently); it settles in one or two.
_TRAIN_TRIES = 4


def prepare(opts: PrepareOptions, stderr=None) -> dict:
    """Writes the prepared folder at opts.out and returns its index; PrepareError on bad input.
    Progress and notes go to `stderr` (default: sys.stderr as it is at the call)."""
    stderr = sys.stderr if stderr is None else stderr
    opts.check()
    out = os.path.abspath(opts.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    threshold = opts.val_fraction * 2.0 ** 64
    for _ in range(_TRAIN_TRIES if opts.train_tokenizer else 2):
        work = tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=os.path.dirname(out))
        try:
            spec = _tokenizer(opts, threshold, work, stderr)
            tmp = os.path.join(work, "out")
            os.mkdir(tmp)      # the umask's mode (mkdtemp's 0700 would lock out other users)
            try:
                index = _write(opts, spec, tmp, stderr, threshold)
            except _MoreValidation as more:
                stderr.write(f"prepare: the documents under --val-fraction {opts.val_fraction} hold "
                             f"fewer than --val-tokens {opts.val_tokens:,} tokens; holding out "
                             f"{more.moved:,} more (the lowest hashes, {more.threshold / 2 ** 64:.4g} "
                             "of the hash range) and starting again\n")
                threshold = more.threshold
                continue
            _install(tmp, out)
            return index
        finally:
            shutil.rmtree(work, ignore_errors=True)
    raise PrepareError("the validation split did not settle (each new vocabulary of "
                       "--train-tokenizer counted it short again); pass a smaller --val-tokens "
                       "or a larger --val-fraction")


def _tokenizer(opts: PrepareOptions, threshold: float, work: str, stderr) -> TokenizerSpec:
    if not opts.train_tokenizer:
        return resolve_tokenizer(opts.tokenizer, opts.eos_token)
    job = BlockTokenizer(None, opts, threshold)
    documents = (doc for block in _read_blocks(opts.inputs, opts) for doc in job.documents(block)
                 if doc.strip() and doc_hash(doc, job.key) >= threshold)
    path = os.path.join(work, "tokenizer.json")
    train_bpe(documents, opts.train_tokenizer, path)
    stderr.write(f"prepare: trained a byte-level BPE of {opts.train_tokenizer:,} tokens on the "
                 "training split\n")
    return resolve_tokenizer(path, opts.eos_token)   # finds EOS_TOKEN among the specials


def _install(tmp: str, out: str):
    """Renames the finished folder to `out` (replacing a prepared one, --overwrite)."""
    if os.path.exists(out):          # --overwrite, checked to be a prepared folder
        old = tempfile.mkdtemp(prefix=os.path.basename(out) + ".old-", dir=os.path.dirname(out))
        os.rename(out, os.path.join(old, "dir"))
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)


def _write(opts: PrepareOptions, spec: TokenizerSpec, tmp: str, stderr, threshold: float) -> dict:
    writers = {split: ShardWriter(tmp, split, spec.dtype, opts.shard_tokens)
               for split in ("train", "val")}
    docs = {split: [0] * len(opts.inputs) for split in ("train", "val", "empty")}
    progress = Progress(sum(os.path.getsize(p) for p in opts.inputs), stderr)
    done = tokens = 0
    job = BlockTokenizer(spec, opts, threshold)
    reserve = Reserve(opts.val_tokens) if opts.val_fraction > 0 and opts.val_tokens else None
    for result in _ordered_results(job, _read_blocks(opts.inputs, opts), opts.workers):
        writers["train"].add(result.train, result.lengths["train"])
        writers["val"].add(result.val, result.lengths["val"])
        if reserve is not None:
            reserve.add(result.train_keys)
        for split in docs:
            docs[split][result.file] += getattr(result, f"{split}_docs")
        done += result.raw_bytes
        tokens += len(result.train) + len(result.val)
        progress.update(done, sum(docs["train"]) + sum(docs["val"]), tokens)
    progress.update(done, sum(docs["train"]) + sum(docs["val"]), tokens, final=True)
    for file, path in enumerate(opts.inputs):
        if docs["train"][file] + docs["val"][file] == 0:
            what = " (only empty texts)" if docs["empty"][file] else ""
            raise PrepareError(f"{path}: empty input: no documents{what}")
    if not sum(docs["train"]):
        raise PrepareError(f"every document went to the validation split (--val-fraction "
                           f"{opts.val_fraction}); give more documents or a smaller fraction")
    if reserve is not None:
        counts = {s: w.fill + sum(x["num_tokens"] for x in w.shards) for s, w in writers.items()}
        hint = ("; with .txt inputs, --split-blank-lines makes every paragraph a document"
                if not opts.split_blank_lines and any(input_kind(p) == "txt" for p in opts.inputs)
                else "")
        try:
            raised = raised_threshold(reserve, counts["val"], counts["train"], opts.val_tokens,
                                      hint)
        except ValueError as e:
            raise PrepareError(str(e)) from None
        if raised is not None:
            raise _MoreValidation(*raised)
    elif opts.val_fraction > 0 and not sum(docs["val"]):
        stderr.write(f"prepare: warning: no document fell in the validation split "
                     f"(--val-fraction {opts.val_fraction} of {sum(docs['train'])} documents); "
                     f"evaluation on this folder will refuse to run\n")
    tokenizer = {"kind": spec.kind, "sha256": spec.sha256, "vocab_size": spec.vocab_size,
                 "eos_id": spec.eos_id, "eos_token": spec.eos_token, "eos_from": spec.eos_from}
    if spec.kind != "bytes":
        shutil.copyfile(spec.path, os.path.join(tmp, "tokenizer.json"))
        tokenizer.update(file="tokenizer.json", source=spec.path)
    if opts.train_tokenizer:
        tokenizer["source"] = (f"moepar data prepare --train-tokenizer {opts.train_tokenizer}: a "
                               "byte-level BPE trained on this folder's train split")
    index = {
        "format": FORMAT, "version": VERSION, "dtype": spec.dtype, "tokenizer": tokenizer,
        "splits": {split: w.summary(sum(docs[split])) for split, w in writers.items()},
        "split_rule": {"seed": opts.seed, "val_fraction": opts.val_fraction,
                       "val_tokens": opts.val_tokens, "threshold": int(threshold),
                       "hash": "blake2b-64 of the document's UTF-8 text keyed by the seed, "
                               "below the threshold (val_fraction * 2^64, or raised so that "
                               "val holds val_tokens)"},
        "inputs": [{"path": path, "train_documents": docs["train"][i],
                    "val_documents": docs["val"][i], "empty_documents_skipped": docs["empty"][i]}
                   for i, path in enumerate(opts.inputs)],
        "options": {"text_field": opts.text_field, "split_blank_lines": opts.split_blank_lines,
                    "shard_tokens": opts.shard_tokens},
        "created_by": f"moepar {__version__}",
    }
    with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    return index
