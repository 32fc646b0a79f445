"""Training data: a byte-level tokenizer, the token sources, and a resumable window sampler.

Sources: `builtin` (the English help text that CPython ships in `pydoc_data.topics`, so the tiny
run needs no download), `text` (a UTF-8 file, byte-tokenized), `tokens` (pre-tokenized ids as a raw
array of `data.token_dtype` or a `.npy` file, memory-mapped, never read whole).
"""

import os

import numpy as np
import torch

from moepar.config import DataConfig

__all__ = ["ByteTokenizer", "load_tokens", "check_token_range", "WindowSampler"]


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def builtin_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """A 1-D array of token ids (memory-mapped for token files)."""
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
    if cfg.path.endswith(".npy"):
        tokens = np.load(cfg.path, mmap_mode="r")
    else:
        itemsize = np.dtype(cfg.token_dtype).itemsize

        size = os.path.getsize(cfg.path)
        if size % itemsize:
            raise ValueError(f"data.path={cfg.path!r} has {size} bytes, not a whole number of "
                             f"data.token_dtype={cfg.token_dtype} tokens ({itemsize} bytes each)")
        tokens = np.memmap(cfg.path, dtype=cfg.token_dtype, mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"data.path={cfg.path!r} must hold a 1-D integer array, got "
                         f"{tokens.dtype} with shape {tokens.shape}")
    return tokens


def check_token_range(tokens: np.ndarray, vocab_size: int, name: str, chunk: int = 1 << 24):
    """Raises naming the first chunk with an id outside [0, vocab_size); reads memmaps in chunks."""
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
    `position`, the number of micro-batches handed out."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 vocab_size: int, name: str = "data"):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{name} has {len(tokens)} tokens, fewer than train.seq_len+1="
                             f"{seq_len + 1}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.vocab_size, self.name = seed, vocab_size, name
        self.position = 0

    def batch(self, index: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size,), generator=gen)
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts.tolist()])
        window_BS = torch.from_numpy(rows.astype(np.int64))
        top = int(window_BS.max())
        if top >= self.vocab_size or int(window_BS.min()) < 0:
            raise ValueError(f"{self.name}: token id {top} in micro-batch {index} is outside "
                             f"[0, model.vocab_size={self.vocab_size})")
        return window_BS[:, :-1], window_BS[:, 1:]

    def next(self):
        inputs_BS, targets_BS = self.batch(self.position)
        self.position += 1
        return inputs_BS, targets_BS
