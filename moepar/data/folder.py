"""Reading a folder written by `moepar data prepare`: its index, and each split's shards as one
memory-mapped token sequence that is never read whole.

    DIR/index.json          format, dtype, tokenizer (sha256, vocab_size, eos_id), splits
    DIR/train-00000.npy     1-D uint16/uint32 shards; a split is its shards concatenated
    DIR/val-00000.npy       the held-out documents
    DIR/tokenizer.json      a copy of the tokenizer used (absent for the byte tokenizer)

Every shard's .npy header and file size are checked against the index before it is opened, so a
truncated or damaged file is an error naming it, and the first time a process opens a split its
shards' SHA-256 are checked against the index (every byte read once, on up to 4 threads:
1.2-1.4 s per GiB from the page cache on this project's shared 2-core machine; a file already
verified in this process, unchanged since, is not read again). Tokens are then read with pread, never through a memory map: a file truncated while
training runs is an error naming it, where a map would kill the process with SIGBUS.

The index names its shards by plain file names inside the folder (no '/', no '..'); a name may
be a symlink (shards linked in from elsewhere), which is followed, and must end at a regular
file. FIFOs, devices and directories are refused by name before anything reads them.
"""

import bisect
import collections
import concurrent.futures
import hashlib
import os

import numpy as np

from moepar.jsonfile import FileError, Int, List, Map, Obj, Str, open_regular, read_json

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
        self.fd = None
        try:
            f = open_regular(path, f"{label}:")     # refuses a FIFO or a device by name
        except FileError as e:
            raise ValueError(str(e)) from None
        self.fd = os.dup(f.fileno())
        f.close()

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
        with open_regular(path, f"{label}:") as f:
            size = os.fstat(f.fileno()).st_size
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, fortran, found = read(f)
            offset = f.tell()
    except FileError as e:
        if not os.path.lexists(path):
            raise ValueError(f"{label}: {path} is missing") from None
        raise ValueError(str(e)) from None
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


_HEX = Str(pattern=r"[0-9a-f]{64}")
_SHARD = Obj({"file": Str(pattern=r"[^/\\\x00]+"), "num_tokens": Int(0, 1 << 53),
              "sha256": _HEX}, required=("file", "num_tokens", "sha256"))
INDEX_SCHEMA = Obj({
    "format": Str(), "version": Int(),
    "dtype": Str(choices=SHARD_DTYPES),
    "tokenizer": Obj({"sha256": Str(), "vocab_size": Int(1, 1 << 32), "eos_id": Int(0, 1 << 32)},
                     required=("sha256", "vocab_size", "eos_id")),
    "splits": Map(Obj({"shards": List(_SHARD, max_len=1 << 20),
                       "documents": Obj({"file": Str(pattern=r"[^/\\\x00]+"),
                                         "num_documents": Int(0, 1 << 53), "sha256": _HEX},
                                        required=("file", "num_documents", "sha256"))},
                      required=("shards",)))},
    required=("format", "version", "dtype", "tokenizer", "splits"))

# Files whose SHA-256 this process has checked: (real path, size, mtime, inode) -> sha256
_verified: dict[tuple, str] = {}


def _file_key(path: str) -> tuple:
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(1 << 22):       # hashlib lets go of the GIL for large updates
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(files: list[tuple[str, str]], label: str, threads: int = 4):
    """Checks each (path, expected sha256), reading every byte once on up to `threads`
    threads; ValueError naming the first file that does not match. Files verified earlier in
    this process and unchanged since are not read again."""
    todo = [(p, want) for p, want in files if _verified.get(_file_key(p)) != want]
    if not todo:
        return
    workers = max(1, min(threads, os.cpu_count() or 1, len(todo)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        found = list(pool.map(lambda item: _sha256(item[0]), todo))
    for (path, want), got in zip(todo, found, strict=True):
        if got != want:
            raise ValueError(f"{label}: {path} does not match its SHA-256 in {INDEX} ({got[:12]}... "
                             f"instead of {want[:12]}...): the file is damaged or was changed "
                             "after `moepar data prepare`; prepare the folder again")
        _verified[_file_key(path)] = want


class PreparedFolder:
    """A prepared folder's index, validated; `split(name)` gives that split's tokens."""

    def __init__(self, path: str, label: str):
        self.path, self.label = path, label
        index_path = os.path.join(path, INDEX)
        if not os.path.lexists(index_path):
            raise ValueError(f"{label}={path!r} has no {INDEX}: prepare it with `moepar data "
                             "prepare ... --out DIR`")
        try:
            index = read_json(index_path, Obj({"format": Str(), "version": Int()}), f"{label}:")
            if index.get("format") != FORMAT:
                raise ValueError(f"{label}: {index_path} is not a moepar token index (format "
                                 f"{index.get('format')!r})")
            if index.get("version") != VERSION:
                raise ValueError(f"{label}: {index_path} has version {index.get('version')!r}; "
                                 f"this moepar reads version {VERSION}")
            INDEX_SCHEMA.check(index, f"{label}: {index_path}", "")
        except FileError as e:
            raise ValueError(f"{e}; prepare the folder again with `moepar data prepare`") from None
        self.index = index
        self.dtype = index["dtype"]
        self.tokenizer_sha256 = index["tokenizer"]["sha256"]
        self.vocab_size = index["tokenizer"]["vocab_size"]
        self.eos_id = index["tokenizer"]["eos_id"]
        self.shards = {split: entry["shards"] for split, entry in index["splits"].items()}
        for split, shards in self.shards.items():
            for shard in shards:
                if shard["file"] in (".", ".."):
                    raise ValueError(f"{label}: {index_path} names the shard {shard['file']!r}, "
                                     "which is not a file inside the folder")
        self._splits: dict[str, ShardedTokens] = {}

    def num_tokens(self, split: str) -> int:
        return sum(s["num_tokens"] for s in self.shards.get(split, []))

    def split(self, name: str) -> ShardedTokens:
        if name not in self.shards:
            raise ValueError(f"{self.label}={self.path!r} has no '{name}' split (it has "
                             f"{', '.join(self.shards) or 'none'})")
        if name not in self._splits:
            shards = self.shards[name]
            label = f"{self.label}={self.path!r}"
            paths = [os.path.join(self.path, s["file"]) for s in shards]
            tokens = ShardedTokens(paths, [s["num_tokens"] for s in shards], self.dtype, label)
            check_sha256([(p, s["sha256"]) for p, s in zip(paths, shards, strict=True)], label)
            self._splits[name] = tokens
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
