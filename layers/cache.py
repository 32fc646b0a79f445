"""The KV cache of incremental decoding: what each attention layer keeps of the positions it has
seen, so that new tokens attend to them without running them through the model again.

Legend: B batch, G key/value heads, H query heads, T new positions, L cached positions after
them, M capacity, Hd head dim, C the MLA kv latent rank, R its RoPE dims, N/V its no-RoPE key
and value head dims.

| attention | keeps per position                            | numbers per token and layer  |
|-----------|-----------------------------------------------|------------------------------|
| GQA       | k after RoPE and v, [B, G, M, Hd] each         | 2 * G * Hd                   |
| MLA       | the normalised kv latent [B, M, C] and the     | C + R (DeepSeek-V3: 576,     |
|           | rotated shared key part [B, M, R]              | not H * (N + R + V) = 40960) |

An MLA layer with a non-empty cache attends in the latent space (the up-projection folded into
the query and the output, DeepSeek-V2's "absorbed" form), so k and v are never expanded for the
cached positions. Buffers are allocated on the first append, for `capacity` positions, in the
dtype and on the device of what is appended. Each layer appends once per model call; the
cache's length is its layers' (they agree).
"""

import torch
import torch.nn.functional as F

__all__ = ["KVCache", "LayerCache", "causal_attention"]


class LayerCache:
    """One attention layer's cached tensors, each growing along `seq_dim`."""

    def __init__(self, capacity: int):
        self.capacity, self.length, self.buffers = capacity, 0, None

    def extend(self, seq_dim: int, *new: torch.Tensor) -> list[torch.Tensor]:
        """Stores `new` (positions length .. length+T) and returns each cached tensor up to there."""
        start, count = self.length, new[0].shape[seq_dim]
        if start + count > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {start} are used and "
                             f"{count} more do not fit")
        if self.buffers is None:
            self.buffers = [t.new_empty(t.shape[:seq_dim] + (self.capacity,) + t.shape[seq_dim + 1:])
                            for t in new]
        out = []
        for buffer, t in zip(self.buffers, new, strict=True):
            buffer.narrow(seq_dim, start, count).copy_(t)
            out.append(buffer.narrow(seq_dim, 0, start + count))
        self.length = start + count
        return out


class KVCache:
    """Every attention layer's LayerCache; `length` positions are cached."""

    def __init__(self, num_layers: int, capacity: int):
        self.capacity = capacity
        self.layers = [LayerCache(capacity) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


def causal_mask_TL(start: int, num_new: int, device) -> torch.Tensor | None:
    """True where new position start+t may see cached position l (l <= start+t); None when every
    new position sees everything (one new token)."""
    if num_new == 1:
        return None
    positions_L = torch.arange(start + num_new, device=device)
    return positions_L[None, :] <= (start + torch.arange(num_new, device=device))[:, None]


def causal_attention(q_BHTd, k_BGLd, v_BGLd, start: int, scale: float | None = None,
                     mask_B1TL=None):
    """SDPA of T new queries (positions start..start+T-1) over L = start+T keys and values;
    G < H key/value heads are shared by groups of queries (GQA). With nothing cached it is
    the training forward's call (is_causal), so a prefill equals a full forward exactly.
    `mask_B1TL` (packed documents, documents.py): the boolean mask to use instead of causal."""
    gqa = k_BGLd.shape[1] != q_BHTd.shape[1]
    if mask_B1TL is not None:
        return F.scaled_dot_product_attention(q_BHTd, k_BGLd, v_BGLd, attn_mask=mask_B1TL,
                                              scale=scale, enable_gqa=gqa)
    if start == 0:
        return F.scaled_dot_product_attention(q_BHTd, k_BGLd, v_BGLd, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    mask_TL = causal_mask_TL(start, q_BHTd.shape[2], q_BHTd.device)
    return F.scaled_dot_product_attention(q_BHTd, k_BGLd, v_BGLd, attn_mask=mask_TL, scale=scale,
                                          enable_gqa=gqa)
