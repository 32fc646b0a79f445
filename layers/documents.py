"""Packed documents in a micro-batch: which positions may attend to which, each token's RoPE
position inside its document, and which positions are padding, all built from one [B, S] tensor
of document numbers, once per forward, and shared by every block.

Legend: B rows (sequences), S positions per row, T = B*S tokens.

`documents_BS[b, s]` is the number of the document that position s of row b belongs to,
non-decreasing along the row (0, 0, 0, 1, 1, 2, ...); -1 marks padding (`data.pad`, after the
row's documents). What the model does with it:

| part                    | without documents          | with documents                              |
|-------------------------|----------------------------|---------------------------------------------|
| attention (GQA, MLA)    | causal (SDPA is_causal)     | causal and within the document: SDPA with a |
|                         |                            | boolean [B, 1, S, S] mask                   |
| RoPE positions          | 0 .. S-1                   | 0 .. at each document start                 |
| router statistics,      | every token                | real tokens only (padding never takes an    |
| balance and z losses    |                            | expert slot, is never sent, counts nothing) |
| sequence balance loss   | per row                    | per document                                |

Padding rows attend to padding only, so no softmax row is empty (no NaN); their outputs feed
nothing that is counted. No host sync: everything here stays on the device.
"""

from dataclasses import dataclass

import torch

__all__ = ["Documents", "build_documents"]


@dataclass(frozen=True)
class Documents:
    mask_B1SS: torch.Tensor     # bool: query s sees key s' (s' <= s, same document)
    positions_BS: torch.Tensor  # int64: the position inside its document (RoPE)
    valid_T: torch.Tensor       # bool: a real token, not padding
    doc_T: torch.Tensor         # int64 in [0, T): one number per document of the micro-batch


def build_documents(documents_BS: torch.Tensor) -> Documents:
    """The masks and positions of a micro-batch's document numbers (see the module text)."""
    if documents_BS.dim() != 2:
        raise ValueError(f"documents must be [B, S] document numbers, got shape "
                         f"{tuple(documents_BS.shape)}")
    num_rows, seq = documents_BS.shape
    idx_S = torch.arange(seq, device=documents_BS.device)
    causal_SS = idx_S[None, :] <= idx_S[:, None]
    same_BSS = documents_BS[:, :, None] == documents_BS[:, None, :]
    # A document starts where the number changes (and at each row's start); its first index,
    # carried forward by a running maximum, gives every token its position inside it.
    new_BS = torch.ones_like(documents_BS, dtype=torch.bool)
    new_BS[:, 1:] = documents_BS[:, 1:] != documents_BS[:, :-1]
    start_BS = torch.where(new_BS, idx_S, 0).cummax(dim=1).values
    rows_B1 = torch.arange(num_rows, device=documents_BS.device)[:, None]
    doc_T = (rows_B1 * seq + documents_BS.clamp_min(0)).reshape(-1)
    return Documents((same_BSS & causal_SS).unsqueeze(1), idx_S - start_BS,
                     (documents_BS >= 0).reshape(-1), doc_T)
