"""Token sources and the window sampler: the byte tokenizer, one-array sources, and micro-batches
drawn as a pure function of (seed, micro-batch index).

One-array sources: `builtin` (the English help text that CPython ships in `pydoc_data.topics`, so
the tiny run needs no download), `text` (a UTF-8 file, byte-tokenized), `tokens` with a single file
(ids as a raw array of `data.token_dtype` or a `.npy` file, read by windows, never whole).
Prepared folders (folder.py) give the same interface: len() and contiguous slices.
"""

import os

import numpy as np
import torch

from moepar.data.folder import PreparedFolder, TokenFile, is_prepared, open_npy

__all__ = ["ByteTokenizer", "load_tokens", "check_token_range", "WindowSampler", "builtin_text"]


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; `moepar data prepare --tokenizer bytes` ends documents with
    `eos_id` 255 (0xFF never occurs in UTF-8, so the vocabulary stays 256)."""
    vocab_size = 256
    eos_id = 0xFF

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def builtin_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def read_token_file(path: str, token_dtype: str, label: str):
    """One token file: a .npy (header and size checked) or a raw array of token_dtype, read by
    slices (TokenFile: a file truncated later is an error, not a SIGBUS)."""
    if path.endswith(".npy"):
        return open_npy(path, label)
    itemsize = np.dtype(token_dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise ValueError(f"{label}={path!r} has {size} bytes, not a whole number of "
                         f"data.token_dtype={token_dtype} tokens ({itemsize} bytes each)")
    return TokenFile(path, token_dtype, 0, size // itemsize, label)


def load_tokens(cfg):
    """The training tokens of a one-path config: a 1-D array (memory-mapped for token files), or a
    prepared folder's train split (a ShardedTokens). Blends go through build_sampler."""
    if cfg.source == "builtin":
        return ByteTokenizer().encode(builtin_text())
    if cfg.source == "text":
        with open(cfg.path, "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"data.path={cfg.path!r} is not UTF-8 text: {e}") from None
        return np.frombuffer(data, dtype=np.uint8)
    if cfg.paths:
        raise ValueError("load_tokens reads one source; data.paths is a blend (use build_sampler)")
    if is_prepared(cfg.path):
        return PreparedFolder(cfg.path, "data.path").split("train")
    return read_token_file(cfg.path, cfg.token_dtype, "data.path")


def check_token_range(tokens: np.ndarray, vocab_size: int, name: str, chunk: int = 1 << 24):
    """Raises naming the first chunk with an id outside [0, vocab_size); reads files in chunks."""
    if tokens.dtype == np.uint8 and vocab_size >= 256:
        return
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start:start + chunk])
        low, high = int(part.min()), int(part.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            where = start + int(np.argmax(part == bad))
            raise ValueError(f"{name}: token id {bad} at position {where} is outside "
                             f"[0, model.vocab_size={vocab_size})")


class WindowSampler:
    """Micro-batch i is `batch_size` random windows of seq_len+1 tokens, drawn from a generator
    seeded by (seed, i): any batch can be rebuilt from its index, so the sampler's whole state is
    `position`, the number of micro-batches handed out. Windows may span document boundaries
    (EOS tokens in between), as in GPT-style pretraining."""

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int,
                 vocab_size: int, name: str = "data"):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{name} has {len(tokens)} tokens, fewer than train.seq_len+1="
                             f"{seq_len + 1}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.vocab_size, self.name = seed, vocab_size, name
        self.position = 0
        self.fingerprint: dict | None = None     # set by build_sampler; stored in checkpoints

    def windows(self, gen: torch.Generator) -> list[np.ndarray]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size,), generator=gen)
        return [np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts.tolist()]

    def batch(self, index: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        window_BS = torch.from_numpy(np.stack(self.windows(gen)).astype(np.int64))
        top = int(window_BS.max())
        if top >= self.vocab_size or int(window_BS.min()) < 0:
            raise ValueError(f"{self.name}: token id {top} in micro-batch {index} is outside "
                             f"[0, model.vocab_size={self.vocab_size})")
        return window_BS[:, :-1], window_BS[:, 1:]

    def next(self):
        inputs_BS, targets_BS = self.batch(self.position)
        self.position += 1
        return inputs_BS, targets_BS
