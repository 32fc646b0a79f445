"""What training reads, built from `[data]`: the sources, their blend, the dataset fingerprint a
checkpoint keeps, and the fixed validation batches.

    data.path  = DIR               one prepared folder (or a single token file, or a text file)
    data.paths = [A, B], data.weights = [0.7, 0.3]
                                   a blend: each window comes from source k with probability w_k

`build_sampler(cfg)` is all the trainer calls; the sampler's whole state stays `position`.
"""

import dataclasses
import hashlib
import math

import numpy as np
import torch

from moepar.data.documents import document_numbers, pack_window, read_document_ends
from moepar.data.folder import PreparedFolder, is_prepared
from moepar.data.packing import PackedSampler
from moepar.data.tokens import WindowSampler, check_token_range, load_tokens, read_token_file

__all__ = ["Source", "open_sources", "build_sampler", "BlendedSampler", "fingerprint",
           "check_same_dataset", "validation_batches"]

_SAMPLE_BYTES = 1 << 20


@dataclasses.dataclass
class Source:
    label: str                        # "data.path" or "data.paths[k]", for messages
    path: str
    folder: PreparedFolder | None     # None for builtin, text and single token files
    identity: dict                    # this source's part of the fingerprint


def _file_identity(path: str, tokens) -> dict:
    """A single token file, without reading it whole: its length, dtype, and a hash of its first
    and last MiB (a prepared folder has real hashes in its index)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, len(tokens) * tokens.dtype.itemsize - _SAMPLE_BYTES), 0)
        digest.update(f.read(_SAMPLE_BYTES))
    return {"kind": "file", "dtype": tokens.dtype.name, "train_tokens": len(tokens),
            "head_tail_sha256": digest.hexdigest()}


def open_sources(data) -> list[tuple[Source, object]]:
    """[(source, its training tokens)] for a DataConfig; raises ValueError naming the key."""
    if data.source in ("builtin", "text"):
        tokens = load_tokens(data)
        ident = {"kind": data.source, "train_tokens": len(tokens),
                 "sha256": hashlib.sha256(memoryview(np.ascontiguousarray(tokens))).hexdigest()}
        return [(Source(f"data.source={data.source}", data.path, None, ident), tokens)]
    labelled = ([("data.path", data.path)] if data.path else
                [(f"data.paths[{k}]", p) for k, p in enumerate(data.paths)])
    out = []
    for label, path in labelled:
        if is_prepared(path):
            folder = PreparedFolder(path, label)
            out.append((Source(label, path, folder, folder.identity()), folder.split("train")))
        else:
            tokens = read_token_file(path, data.token_dtype, label)
            out.append((Source(label, path, None, _file_identity(path, tokens)), tokens))
    _check_same_tokenizer([s for s, _ in out])
    return out


def _check_same_tokenizer(sources: list[Source]):
    folders = [s for s in sources if s.folder is not None]
    for other in folders[1:]:
        first = folders[0]
        for key in ("tokenizer_sha256", "eos_id"):
            if other.identity[key] != first.identity[key]:
                raise ValueError(f"{other.label}={other.path!r} was prepared with another "
                                 f"tokenizer than {first.label}={first.path!r} ({key} "
                                 f"{other.identity[key]} vs {first.identity[key]}); blend only "
                                 "folders prepared with the same tokenizer")


def _weights(data, sizes: list[int]) -> list[float]:
    """Normalised blend weights: data.weights, or by size (as if the sources were concatenated)."""
    raw = list(data.weights) if data.weights else [float(n) for n in sizes]
    total = math.fsum(raw)
    return [w / total for w in raw]


def fingerprint(data) -> dict:
    """The dataset's identity for checkpoints: each source's identity and the blend weights."""
    opened = open_sources(data)
    return _fingerprint(data, [s for s, _ in opened], [len(t) for _, t in opened])


def _fingerprint(data, sources: list[Source], sizes: list[int]) -> dict:
    return {"sources": [dict(s.identity) for s in sources], "weights": _weights(data, sizes)}


def check_same_dataset(saved: dict | None, current: dict):
    """Raises ValueError naming every difference between a checkpoint's dataset fingerprint and
    the current one. `saved` None (a checkpoint from before fingerprints, or a converted model)
    passes."""
    if saved is None:
        return
    diffs = []
    old, new = saved.get("sources", []), current.get("sources", [])
    if len(old) != len(new):
        diffs.append(f"{len(old)} source(s) in the checkpoint, {len(new)} now")
    for k, (a, b) in enumerate(zip(old, new)):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"source {k} {key}: checkpoint {a.get(key)!r}, now {b.get(key)!r}")
    if len(old) == len(new) and saved.get("weights") != current.get("weights"):
        diffs.append(f"blend weights: checkpoint {saved.get('weights')}, now "
                     f"{current.get('weights')}")
    if diffs:
        raise ValueError("resuming on another dataset than the checkpoint's: " + "; ".join(diffs)
                         + ". Point [data] at the checkpoint's data, or start a new run from its "
                         "weights with --run.init_from")


class BlendedSampler(WindowSampler):
    """Each row of micro-batch i picks source k with probability weights[k], then a uniform window
    in it; all draws come from the generator seeded by (seed, i), so resume stays exact."""

    def __init__(self, sources: list, weights: list[float], seq_len: int, batch_size: int,
                 seed: int, vocab_size: int, names: list[str]):
        for tokens, name in zip(sources, names, strict=True):
            if len(tokens) < seq_len + 1:
                raise ValueError(f"{name} has {len(tokens)} tokens, fewer than train.seq_len+1="
                                 f"{seq_len + 1}")
        super().__init__(sources[0], seq_len, batch_size, seed, vocab_size, name=", ".join(names))
        self.sources, self.weights = sources, weights
        self.cum_weights = torch.tensor(np.cumsum(weights), dtype=torch.float64)

    def windows(self, gen: torch.Generator) -> list[np.ndarray]:
        u = torch.rand(self.batch_size, generator=gen, dtype=torch.float64)
        which = torch.searchsorted(self.cum_weights, u, right=True).clamp_(max=len(self.sources) - 1)
        draws = torch.randint(0, 1 << 62, (self.batch_size,), generator=gen)
        rows = []
        for k, r in zip(which.tolist(), draws.tolist()):
            tokens = self.sources[k]
            start = r % (len(tokens) - self.seq_len)   # bias < 2^-30 for any real dataset size
            rows.append(np.asarray(tokens[start:start + self.seq_len + 1]))
        return rows


def build_sampler(cfg):
    """The training sampler for a RunConfig, with its dataset fingerprint; every check (vocab fit,
    shard sizes, same tokenizer across a blend) runs here, before any process group exists."""
    data, t, vocab = cfg.data, cfg.train, cfg.model.vocab_size
    opened = open_sources(data)
    for source, tokens in opened:
        if source.folder is not None:
            if source.folder.vocab_size > vocab:
                raise ValueError(f"{source.label}={source.path!r} was tokenized with a vocabulary "
                                 f"of {source.folder.vocab_size} ids, more than model.vocab_size="
                                 f"{vocab}")
        else:   # no index to trust: scan once, in chunks
            check_token_range(tokens, vocab, source.label if data.source == "tokens" else
                              f"data.source={data.source}")
    sources, tokens = [s for s, _ in opened], [t for _, t in opened]
    if data.pack == "documents":     # one prepared folder (config.py refuses the others)
        if sources[0].folder is None:
            raise ValueError(f"data.pack='documents': data.path={data.path!r} is not a folder "
                             "from `moepar data prepare` (a token file records no documents)")
        sampler = PackedSampler(sources[0].folder, tokens[0], t.seq_len, t.micro_batch_size,
                                t.seed, vocab, sources[0].label, data.pad)
    elif len(sources) == 1:
        name = sources[0].label if data.source == "tokens" else f"data.source={data.source}"
        sampler = WindowSampler(tokens[0], t.seq_len, t.micro_batch_size, t.seed, vocab, name)
    else:
        sampler = BlendedSampler(tokens, _weights(data, [len(x) for x in tokens]), t.seq_len,
                                 t.micro_batch_size, t.seed, vocab, [s.label for s in sources])
    sampler.fingerprint = _fingerprint(data, sources, [len(x) for x in tokens])
    return sampler


def _allot(total: int, weights: list[float]) -> list[int]:
    """total split by weights, largest remainders first (ties to the earlier source)."""
    exact = [total * w for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: (counts[k] - exact[k], k))
    for k in by_remainder[:total - sum(counts)]:
        counts[k] += 1
    return counts


def validation_batches(data, num_batches: int, batch_size: int, seq_len: int,
                       vocab_size: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """num_batches (inputs_BS, targets_BS) pairs from the prepared folders' `val` splits: the same
    every call, whatever the training layout. Windows are shared among a blend's sources by its
    weights and spread evenly over each split, never overlapping in the tokens they predict.
    data.pack='documents': (inputs_BS, targets_BS, documents_BS), the windows cut into their
    documents (moepar/data/documents.py)."""
    opened = open_sources(data)
    for source, _ in opened:
        if source.folder is None:
            raise ValueError(f"{source.label}: only folders from `moepar data prepare` have a "
                             "validation split; prepare one with --val-fraction > 0")
    weights = _weights(data, [len(t) for _, t in opened])
    rows, packed = [], []
    for (source, _), count in zip(opened, _allot(num_batches * batch_size, weights), strict=True):
        if count == 0:
            continue
        val = source.folder.split("val")
        span = len(val) - seq_len - 1           # the last possible window start
        need = count * seq_len + 1
        if len(val) < need:
            holds = max(len(val) - 1, 0) // seq_len
            raise ValueError(f"{source.label}={source.path!r}: the validation split has "
                             f"{len(val)} tokens, fewer than {count} windows of train.seq_len="
                             f"{seq_len} need ({need}); prepare the folder again with "
                             f"`moepar data prepare ... --val-tokens {need} --overwrite`, or "
                             f"evaluate fewer windows (it holds {holds}: train.eval_batches x "
                             f"train.global_batch_size of them)")
        ends = read_document_ends(source.folder, "val", source.label) \
            if data.pack == "documents" else None
        for j in range(count):
            start = span * j // max(count - 1, 1)
            rows.append(np.asarray(val[start:start + seq_len + 1]))
            if ends is not None:   # the same windows, cut into their documents (never padded)
                packed.append(pack_window(rows[-1].astype(np.int64), document_numbers(
                    start, ends, seq_len, pad=False), source.folder.eos_id))
    window_BS = torch.from_numpy(np.stack(rows).astype(np.int64))
    if vocab_size is not None and int(window_BS.max()) >= vocab_size:
        raise ValueError(f"validation data: token id {int(window_BS.max())} is outside "
                         f"[0, model.vocab_size={vocab_size})")
    if packed:
        columns = [torch.from_numpy(np.stack(col)).split(batch_size) for col in zip(*packed)]
        return list(zip(*columns, strict=True))
    return [(w[:, :-1], w[:, 1:]) for w in window_BS.split(batch_size)]
