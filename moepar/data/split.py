"""Which documents `moepar data prepare` holds out for validation: the hash rule, and how far its
threshold is raised so that a small corpus still holds the windows an evaluation reads.

A document goes to `val` when blake2b-64(seed, its UTF-8 text), read as an integer, is below the
threshold; the threshold starts at val_fraction * 2^64. Whole documents, the same split for the
same text whatever the input order, duplicates on one side. When those documents hold fewer than
`val_tokens` tokens (default: what the default evaluation reads, `default_val_tokens()`), the
threshold is raised to just above the hash of the training document that completes them, taking
documents in hash order: the split is still a function of the text alone, only of a larger
share. A raise that would leave training fewer tokens than validation is refused instead, with
the flags that would work.
"""

import hashlib
import heapq

__all__ = ["default_val_tokens", "seed_key", "doc_hash", "Reserve", "raised_threshold"]


def default_val_tokens() -> int:
    """Tokens the default evaluation reads: train.eval_batches x train.global_batch_size windows
    of train.seq_len, the last target included (the config's own defaults: 1 x 16 x 128 + 1)."""
    from moepar.config import TrainConfig
    t = TrainConfig()
    return t.eval_batches * t.global_batch_size * t.seq_len + 1


def seed_key(seed: int) -> bytes:
    return seed.to_bytes(16, "little", signed=True)


def doc_hash(text: str, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), key=key, digest_size=8).digest(),
                          "little")


class Reserve:
    """The lowest-hash training documents that together hold at least `need` tokens, as
    (hash, tokens): a max-heap by hash, so memory is bounded by `need` documents whatever the
    corpus size."""

    def __init__(self, need: int):
        self.need, self.tokens, self._heap = need, 0, []

    def add(self, keys):
        for h, n in keys:
            if self._heap and self.tokens >= self.need and h > -self._heap[0][0]:
                continue               # above every document already enough
            heapq.heappush(self._heap, (-h, n))
            self.tokens += n
            while self.tokens - self._heap[0][1] >= self.need:   # the rest still suffice
                self.tokens -= heapq.heappop(self._heap)[1]

    def ascending(self) -> list[tuple[int, int]]:
        return sorted((-h, n) for h, n in self._heap)


def raised_threshold(reserve: Reserve, val_tokens: int, train_tokens: int, need: int,
                     flag_hint: str = "") -> tuple[int, int] | None:
    """(the raised threshold, documents it moves) when the validation split holds fewer than
    `need` tokens, else None. Raises ValueError, naming the flags to pass, when the raise would
    leave training fewer tokens than validation."""
    if val_tokens >= need:
        return None
    total, held, fits_half = val_tokens + train_tokens, val_tokens, val_tokens
    for moved, (h, n) in enumerate(reserve.ascending(), start=1):
        held += n
        if held > total - held:
            break
        fits_half = held
        if held >= need:
            return h + 1, moved
    ways = (f"--val-tokens {fits_half} (and evaluate at most that many: train.eval_batches x "
            f"train.global_batch_size x train.seq_len + 1 <= {fits_half}), or " if fits_half > 1
            else "")
    raise ValueError(
        f"the validation split holds {val_tokens:,} tokens, fewer than --val-tokens {need:,} "
        f"(default: what the default evaluation reads), and the corpus ({total:,} tokens) cannot "
        f"hold out that many in whole documents and keep at least as many for training; pass "
        f"{ways}--val-fraction 0 for no validation split{flag_hint}")
