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
    mask_B1SS: torch.Tensor     # bool: query s sees key s' (s' <= s, same document); [B, 1, S, L]
                                # when decoding after L - S cached positions
    positions_BS: torch.Tensor  # int64: the position inside its document (RoPE)
    valid_T: torch.Tensor       # bool: a real token, not padding
    doc_T: torch.Tensor         # int64 in [0, T): one number per document of the micro-batch


def build_documents(documents_BL: torch.Tensor, start: int = 0) -> Documents:
    """The masks and positions of a micro-batch's document numbers (see the module text).
    Decoding with a KV cache: `documents_BL` covers the L = start + S cached and new positions,
    and what is built is the S new positions' (their mask rows over all L keys)."""
    if documents_BL.dim() != 2 or not 0 <= start < documents_BL.shape[1]:
        raise ValueError(f"documents must be [B, L] document numbers covering the {start} cached "
                         f"positions and at least one new one, got shape "
                         f"{tuple(documents_BL.shape)}")
    num_rows, length = documents_BL.shape
    idx_L = torch.arange(length, device=documents_BL.device)
    causal_SL = idx_L[None, :] <= idx_L[start:, None]
    same_BSL = documents_BL[:, start:, None] == documents_BL[:, None, :]
    # A document starts where the number changes (and at each row's start); its first index,
    # carried forward by a running maximum, gives every token its position inside it.
    new_BL = torch.ones_like(documents_BL, dtype=torch.bool)
    new_BL[:, 1:] = documents_BL[:, 1:] != documents_BL[:, :-1]
    start_BL = torch.where(new_BL, idx_L, 0).cummax(dim=1).values
    # Numbers unique over the new tokens, below T = B*S: row * S + the row's count of starts.
    new_BS = new_BL[:, start:].clone()
    new_BS[:, 0] = True
    rows_B1 = torch.arange(num_rows, device=documents_BL.device)[:, None]
    doc_T = (rows_B1 * new_BS.shape[1] + new_BS.cumsum(1) - 1).reshape(-1)
    return Documents((same_BSL & causal_SL).unsqueeze(1), (idx_L - start_BL)[:, start:],
                     (documents_BL[:, start:] >= 0).reshape(-1), doc_T)
