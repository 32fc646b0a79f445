"""Document boundaries of a prepared folder, and the packed windows `data.pack = "documents"`
draws from them.

    DIR/train-documents.npy   int64, the end offset of each document in the split's tokens
    DIR/val-documents.npy     (each end is one past the document's EOS; the last is the split's
                              length), listed in index.json under splits.<split>.documents
                              with its SHA-256. Folders prepared before have none: they still
                              load and train with data.pack = "none".

A packed micro-batch (`pack_window`) is what the model reads (layers/documents.py):

| field       | shape  | what                                                                   |
|-------------|--------|------------------------------------------------------------------------|
| inputs      | [B, S] | token ids (padding: EOS, never attended to by a real token)            |
| targets     | [B, S] | the next token of the same document; -100 where there is none (the     |
|             |        | document's last token, and padding): those count in no loss            |
| documents   | [B, S] | document number in the row, 0, 1, ...; -1 for padding                  |

Windows of `data.pad = false` are the stream's windows (whole documents, with pieces of the
documents cut by its edges); `data.pad = true` starts each window at a document's start and
holds whole documents only (a longer one: its first S+1 tokens), padded at the end.
Numpy only: `moepar data prepare` writes the ends without loading torch.
"""

import bisect
import hashlib
import os

import numpy as np

__all__ = ["documents_file", "write_document_ends", "read_document_ends", "document_numbers",
           "pack_window", "padded_windows", "IGNORE"]

IGNORE = -100     # the target of a position that predicts nothing (layers/loss.py ignore_index)


def documents_file(split: str) -> str:
    return f"{split}-documents.npy"


def write_document_ends(folder: str, split: str, lengths: list[np.ndarray]) -> dict:
    """Writes the split's document end offsets; returns its index entry."""
    ends = np.cumsum(np.concatenate(lengths) if lengths else np.zeros(0, np.int64), dtype=np.int64)
    name = documents_file(split)
    path = os.path.join(folder, name)
    np.save(path, ends)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"file": name, "num_documents": int(len(ends)), "sha256": digest}


def read_document_ends(folder, split: str, label: str) -> np.ndarray:
    """The end offsets of a PreparedFolder's split, checked against its index (count, hash, that
    they rise to the split's length); ValueError naming `label` when the folder has none."""
    entry = folder.index["splits"].get(split, {}).get("documents")
    if entry is None:
        raise ValueError(f"{label}={folder.path!r} records no document boundaries (prepared "
                         "before they were recorded): prepare it again with `moepar data "
                         "prepare ... --overwrite`, or set data.pack='none'")
    path = os.path.join(folder.path, os.path.basename(entry["file"]))
    with open(path, "rb") as f:
        raw = f.read()
    if hashlib.sha256(raw).hexdigest() != entry.get("sha256"):
        raise ValueError(f"{label}: {path} does not match its SHA-256 in index.json; prepare the "
                         "folder again")
    ends = np.load(path)
    total = folder.num_tokens(split)
    if (ends.ndim != 1 or len(ends) != entry.get("num_documents") or
            (len(ends) and (ends[-1] != total or np.any(np.diff(ends) <= 0) or ends[0] <= 0))):
        raise ValueError(f"{label}: {path} does not hold rising document ends up to the "
                         f"split's {total} tokens; prepare the folder again")
    return ends


def document_numbers(start: int, ends: np.ndarray, seq_len: int, pad: bool) -> np.ndarray:
    """[S+1] the document number (in the window) of each position start..start+S (one more:
    the last target's), -1 for padding. With `pad` the window starts at a document start and
    everything after the last whole document that fits is padding."""
    first = bisect.bisect_right(ends, start)
    doc_S1 = np.searchsorted(ends, np.arange(start, start + seq_len + 1), side="right") - first
    if pad:
        # whole documents only: those ending inside the window (at least the first, cut short)
        inside = int(np.searchsorted(ends, start + seq_len + 1, side="right")) - first
        doc_S1 = np.where(doc_S1 < max(inside, 1), doc_S1, -1)
    return doc_S1


def counted_targets(doc_S1: np.ndarray) -> np.ndarray:
    """[S] True where a position's target is the next token of its own document."""
    return (doc_S1[1:] == doc_S1[:-1]) & (doc_S1[:-1] >= 0)


def pack_window(window: np.ndarray, doc_S1: np.ndarray, eos_id: int):
    """(inputs_S, targets_S, documents_S) of the seq_len+1 tokens `window` whose positions
    belong to documents `doc_S1` (document_numbers; see the module text)."""
    same_S = counted_targets(doc_S1)
    inputs = np.where(doc_S1[:-1] >= 0, window[:-1], eos_id)
    targets = np.where(same_S, window[1:], IGNORE)
    return inputs, targets, doc_S1[:-1]


def padded_windows(ends: np.ndarray) -> np.ndarray:
    """The start offset of every document: where `data.pad = true` windows begin."""
    return np.concatenate([[0], ends[:-1]]).astype(np.int64)
