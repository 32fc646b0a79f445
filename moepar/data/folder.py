"""Reading a folder written by `moepar data prepare`: its index, and each split's shards as one
memory-mapped token sequence that is never read whole.

    DIR/index.json          format, dtype, tokenizer (sha256, vocab_size, eos_id), splits
    DIR/train-00000.npy     1-D uint16/uint32 shards; a split is its shards concatenated
    DIR/val-00000.npy       the held-out documents
    DIR/tokenizer.json      a copy of the tokenizer used (absent for the byte tokenizer)

Every shard's .npy header and file size are checked against the index before it is opened, so a
truncated or damaged file is an error naming it. Tokens are then read with pread, never through a
memory map: a file truncated while training runs is an error naming it, where a map would kill
the process with SIGBUS.
"""

import bisect
import collections
import hashlib
import json
import os

import numpy as np

__all__ = ["INDEX", "FORMAT", "VERSION", "PreparedFolder", "ShardedTokens", "TokenFile",
           "open_npy", "is_prepared"]

INDEX, FORMAT, VERSION = "index.json", "moepar-tokens", 1
SHARD_DTYPES = ("uint16", "uint32")


def is_prepared(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX))


class TokenFile:
    """A 1-D array of tokens stored at `offset` in a file: len() and contiguous slices, read with
    pread from one open descriptor (the same file even if it is replaced by rename). A read that
    comes back short (the file shrank) is a ValueError naming the file, not a SIGBUS."""

    def __init__(self, path: str, dtype, offset: int, count: int, label: str):
        self.path, self.dtype, self.offset, self.count, self.label = (
            path, np.dtype(dtype), offset, count, label)
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.count

    @property
    def shape(self) -> tuple:
        return (self.count,)

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenFile supports contiguous slices only")
        start, stop, _ = key.indices(self.count)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        size = self.dtype.itemsize
        want = (stop - start) * size
        data = os.pread(self.fd, want, self.offset + start * size)
        if len(data) != want:
            now = os.fstat(self.fd).st_size
            raise ValueError(f"{self.label}: {self.path} has {now} bytes now, fewer than the "
                             f"{self.offset + self.count * size} it had when training started "
                             "(truncated while training?); restore the file and resume")
        return np.frombuffer(data, dtype=self.dtype)

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None


def open_npy(path: str, label: str, dtype: str | None = None, count: int | None = None):
    """The tokens of a 1-D .npy file (a TokenFile) after checking its header and size (and, when
    given, that they match the expected dtype and token count); ValueError naming `label` else."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, fortran, found = read(f)
            offset = f.tell()
    except FileNotFoundError:
        raise ValueError(f"{label}: {path} is missing") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ValueError(f"{label}: {path} is not a readable .npy file (damaged header: {e})") \
            from None
    if len(shape) != 1 or found.kind not in "iu":
        raise ValueError(f"{label}: {path} must hold a 1-D integer array, got {found} with shape "
                         f"{shape}")
    if dtype is not None and found != np.dtype(dtype):
        raise ValueError(f"{label}: {path} holds {found}, the index says {dtype}")
    if count is not None and shape[0] != count:
        raise ValueError(f"{label}: {path} holds {shape[0]} tokens, the index says {count}")
    want = offset + shape[0] * found.itemsize
    if size != want:
        raise ValueError(f"{label}: {path} has {size} bytes, its header promises {want} "
                         f"({shape[0]} tokens of {found}): the file is truncated or damaged")
    return TokenFile(path, found, offset, shape[0], label)


class ShardedTokens:
    """A split's shards as one 1-D sequence: len() and contiguous slices (which may span shards).
    Shards are checked at construction and opened on use; each holds a file descriptor, so only
    the `max_open` most recently used stay open (a folder may have thousands of shards)."""

    def __init__(self, paths: list[str], counts: list[int], dtype: str, label: str,
                 max_open: int = 64):
        for path, count in zip(paths, counts, strict=True):
            open_npy(path, label, dtype, count)     # checks only; the map is dropped
        self.paths, self.dtype, self.label = paths, np.dtype(dtype), label
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        self.max_open = max_open
        self._maps: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return self.starts[-1]

    def _shard(self, i: int) -> np.ndarray:
        if i in self._maps:
            self._maps.move_to_end(i)
        else:
            self._maps[i] = open_npy(self.paths[i], self.label, self.dtype.name,
                                     self.starts[i + 1] - self.starts[i])
            if len(self._maps) > self.max_open:
                self._maps.popitem(last=False)
        return self._maps[i]

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ShardedTokens supports contiguous slices only")
        start, stop, _ = key.indices(len(self))
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        parts, i = [], bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            end = min(stop, self.starts[i + 1])
            if end > start:
                base = self.starts[i]
                parts.append(np.asarray(self._shard(i)[start - base:end - base]))
            start, i = end, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _need(index: dict, key: str, kind, label: str):
    value = index
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{label}: index.json lacks a valid '{key}' (got {value!r}); prepare "
                         "the folder again with `moepar data prepare`")
    return value


class PreparedFolder:
    """A prepared folder's index, validated; `split(name)` gives that split's tokens."""

    def __init__(self, path: str, label: str):
        self.path, self.label = path, label
        index_path = os.path.join(path, INDEX)
        try:
            with open(index_path, "rb") as f:
                raw = f.read()
            index = json.loads(raw)
        except FileNotFoundError:
            raise ValueError(f"{label}={path!r} has no {INDEX}: prepare it with `moepar data "
                             "prepare ... --out DIR`") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"{label}: {index_path} is not valid JSON: {e}") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ValueError(f"{label}: {index_path} is not a moepar token index "
                             f"(format {index.get('format') if isinstance(index, dict) else None!r})")
        if index.get("version") != VERSION:
            raise ValueError(f"{label}: {index_path} has version {index.get('version')!r}; this "
                             f"moepar reads version {VERSION}")
        self.index = index
        self.dtype = _need(index, "dtype", str, label)
        if self.dtype not in SHARD_DTYPES:
            raise ValueError(f"{label}: index.json dtype {self.dtype!r} is not one of {SHARD_DTYPES}")
        self.tokenizer_sha256 = _need(index, "tokenizer.sha256", str, label)
        self.vocab_size = _need(index, "tokenizer.vocab_size", int, label)
        self.eos_id = _need(index, "tokenizer.eos_id", int, label)
        splits = _need(index, "splits", dict, label)
        self.shards = {}
        for split in splits:
            shards = _need(index, f"splits.{split}.shards", list, label)
            for i, shard in enumerate(shards):
                _need(shard, "file", str, f"{label} (splits.{split}.shards[{i}])")
                _need(shard, "num_tokens", int, f"{label} (splits.{split}.shards[{i}])")
            self.shards[split] = shards
        self._splits: dict[str, ShardedTokens] = {}

    def num_tokens(self, split: str) -> int:
        return sum(s["num_tokens"] for s in self.shards.get(split, []))

    def split(self, name: str) -> ShardedTokens:
        if name not in self.shards:
            raise ValueError(f"{self.label}={self.path!r} has no '{name}' split (it has "
                             f"{', '.join(self.shards) or 'none'})")
        if name not in self._splits:
            shards = self.shards[name]
            self._splits[name] = ShardedTokens(
                [os.path.join(self.path, s["file"]) for s in shards],
                [s["num_tokens"] for s in shards], self.dtype, f"{self.label}={self.path!r}")
        return self._splits[name]

    def identity(self) -> dict:
        """What makes this dataset this dataset, from the index alone (no shard is read): the
        tokenizer, the EOS, the token counts and the shards' hashes."""
        digest = hashlib.sha256()
        for split in sorted(self.shards):
            for shard in self.shards[split]:
                digest.update(f"{split}:{shard['num_tokens']}:{shard.get('sha256', '')};".encode())
        return {"kind": "folder", "tokenizer_sha256": self.tokenizer_sha256,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                **{f"{split}_tokens": self.num_tokens(split) for split in sorted(self.shards)},
                "shards_sha256": digest.hexdigest()}
