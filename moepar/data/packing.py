"""The sampler of `data.pack = "documents"`: micro-batches of packed windows (documents.py) with
each position's document number, drawn as a pure function of (seed, micro-batch index) like
WindowSampler's, so resume stays exact and the sampler's whole state stays `position`.

`counted(i)` is micro-batch i's number of counted targets, from the document ends alone (no
token is read): the trainer weights each micro-batch's mean loss by it, so a step's loss is the
mean over every counted token of the global batch, whatever the layout.
"""

import numpy as np
import torch

from moepar.data.documents import (counted_targets, document_numbers, pack_window,
                                   padded_windows, read_document_ends)
from moepar.data.tokens import WindowSampler

__all__ = ["PackedSampler"]


class PackedSampler(WindowSampler):
    """batch(i) -> (inputs_BS, targets_BS, documents_BS); `pad` = data.pad (see documents.py)."""

    packed = True

    def __init__(self, folder, tokens, seq_len: int, batch_size: int, seed: int,
                 vocab_size: int, name: str, pad: bool):
        super().__init__(tokens, seq_len, batch_size, seed, vocab_size, name)
        self.ends = read_document_ends(folder, "train", name)
        self.eos_id, self.pad = folder.eos_id, pad
        self.doc_starts = padded_windows(self.ends) if pad else None

    def _starts(self, index: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        if not self.pad:     # the windows of data.pack='none', cut into their documents
            return torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size,),
                                 generator=gen).tolist()
        picks = torch.randint(0, len(self.doc_starts), (self.batch_size,), generator=gen)
        return self.doc_starts[picks.numpy()].tolist()

    def counted(self, index: int) -> int:
        """Micro-batch `index`'s counted targets (not -100), from the document ends alone."""
        return sum(int(counted_targets(document_numbers(s, self.ends, self.seq_len,
                                                         self.pad)).sum())
                   for s in self._starts(index))

    def batch(self, index: int):
        rows = []
        for start in self._starts(index):
            window = np.asarray(self.tokens[start:start + self.seq_len + 1])
            if len(window) < self.seq_len + 1:      # a padded window at the split's end
                window = np.concatenate([window, np.full(self.seq_len + 1 - len(window),
                                                         self.eos_id, window.dtype)])
            doc_S1 = document_numbers(start, self.ends, self.seq_len, self.pad)
            rows.append(pack_window(window.astype(np.int64), doc_S1, self.eos_id))
        inputs_BS, targets_BS, documents_BS = (torch.from_numpy(np.stack(col)) for col in zip(*rows))
        top = int(inputs_BS.max())
        if top >= self.vocab_size or int(inputs_BS.min()) < 0:
            raise ValueError(f"{self.name}: token id {top} in micro-batch {index} is outside "
                             f"[0, model.vocab_size={self.vocab_size})")
        return inputs_BS, targets_BS, documents_BS
