"""Exact causal attention of a run of queries over the keys up to their end, tile by tile with an
online softmax, saving only the output and its log-sum-exp for backward: nothing of size
queries x keys is kept, and no mask is made beyond one tile (context parallelism's chunks,
parallel/context.py).

Legend: B batch, H query heads, G key/value heads, r = H/G queries per key/value head, T queries
(at positions start..start+T-1), L = start+T keys (positions 0..L-1), d query/key head dim, e value
head dim (MLA: e != d), t/l a tile of queries/keys.

Forward: for each query tile, the key tiles before it need no mask (the chunk's fully visible
prefix) and the tiles on its diagonal a causal one of one tile; they are merged by log-sum-exp
as they come (running max m, sum s, output o: ring and flash attention's merge), so the result is
softmax(q k^T * scale, causal) v with the final lse = m + log s per query.

Backward (flash/ring attention's): recomputes each tile's scores; with P = exp(S - lse) and
D = rowsum(dO * O), dV += P^T dO, dS = P * (dO v^T - D), dQ += dS k * scale, dK += dS^T q * scale.

Why not torch's kernels that return the log-sum-exp: on CPU,
aten._scaled_dot_product_flash_attention_for_cpu refuses a value head dim that differs from the
query's (MLA), and the CUDA flash/efficient kernels take no float64, so neither gives the float64
parity the tests hold every layout to; this one is plain tensor maths, the same on every device.
Half-precision inputs are computed in float32 (the softmax's numerics), the output cast back.
"""

import torch

__all__ = ["causal_tiled_attention", "TILE"]

TILE = 512
"""Queries and keys per tile: a transient score block of B*H*TILE*TILE numbers (8 MB at B*H = 4
in float64)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _tiles(length: int, tile: int):
    return [(a, min(tile, length - a)) for a in range(0, length, tile)]


def _scores(q_BGrtd, k_BGld, scale, q0: int, k0: int, start: int):
    """Scaled scores of one tile [B, G, r, t, l], -inf where a key lies after its query."""
    s_BGrtl = torch.matmul(q_BGrtd, k_BGld.unsqueeze(2).transpose(-1, -2)) * scale
    t, l = s_BGrtl.shape[-2], s_BGrtl.shape[-1]
    if k0 + l - 1 > start + q0:        # the tile crosses the diagonal
        keys_l = torch.arange(k0, k0 + l, device=s_BGrtl.device)
        queries_t = torch.arange(start + q0, start + q0 + t, device=s_BGrtl.device)
        s_BGrtl = s_BGrtl.masked_fill(keys_l[None, :] > queries_t[:, None], float("-inf"))
    return s_BGrtl


def _key_tiles(q0: int, t: int, start: int, tile: int):
    """The key tiles any query of tile [q0, q0+t) sees."""
    return _tiles(start + q0 + t, tile)


class _CausalTiled(torch.autograd.Function):
    """Saves q, k, v (views of the caller's tensors), the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q_BHTd, k_BGLd, v_BGLe, start: int, scale: float, tile: int):
        # Autocast would run the tiles' matmuls in bf16, under the float32 this computes in.
        with torch.autocast(q_BHTd.device.type, enabled=False):
            return _CausalTiled._forward(ctx, q_BHTd, k_BGLd, v_BGLe, start, scale, tile)

    @staticmethod
    def backward(ctx, dout_BHTe):
        with torch.autocast(dout_BHTe.device.type, enabled=False):
            return _CausalTiled._backward(ctx, dout_BHTe)

    @staticmethod
    def _forward(ctx, q_BHTd, k_BGLd, v_BGLe, start: int, scale: float, tile: int):
        B, H, T, _ = q_BHTd.shape
        G, e = k_BGLd.shape[1], v_BGLe.shape[-1]
        dtype = _compute_dtype(q_BHTd.dtype)
        q_BGrTd = q_BHTd.unflatten(1, (G, H // G))
        out_BGrTe = q_BHTd.new_empty((B, G, H // G, T, e), dtype=dtype)
        lse_BGrT = q_BHTd.new_empty((B, G, H // G, T), dtype=dtype)
        for q0, t in _tiles(T, tile):
            q_t = q_BGrTd.narrow(3, q0, t).to(dtype)
            m = s = o = None
            for k0, l in _key_tiles(q0, t, start, tile):
                s_BGrtl = _scores(q_t, k_BGLd.narrow(2, k0, l).to(dtype), scale, q0, k0, start)
                v_BG1le = v_BGLe.narrow(2, k0, l).to(dtype).unsqueeze(2)
                tile_max = s_BGrtl.amax(-1)
                if m is None:
                    m = tile_max
                    p = torch.exp(s_BGrtl - m.unsqueeze(-1))
                    s, o = p.sum(-1), torch.matmul(p, v_BG1le)
                else:
                    new_m = torch.maximum(m, tile_max)
                    keep = torch.exp(m - new_m)
                    p = torch.exp(s_BGrtl - new_m.unsqueeze(-1))
                    s = s * keep + p.sum(-1)
                    o = o * keep.unsqueeze(-1) + torch.matmul(p, v_BG1le)
                    m = new_m
            out_BGrTe.narrow(3, q0, t).copy_(o / s.unsqueeze(-1))
            lse_BGrT.narrow(3, q0, t).copy_(m + torch.log(s))
        out_BHTe = out_BGrTe.flatten(1, 2).to(q_BHTd.dtype)
        ctx.save_for_backward(q_BHTd, k_BGLd, v_BGLe, out_BHTe, lse_BGrT)
        ctx.start, ctx.scale, ctx.tile = start, scale, tile
        return out_BHTe

    @staticmethod
    def _backward(ctx, dout_BHTe):
        q_BHTd, k_BGLd, v_BGLe, out_BHTe, lse_BGrT = ctx.saved_tensors
        start, scale, tile = ctx.start, ctx.scale, ctx.tile
        G, r = k_BGLd.shape[1], q_BHTd.shape[1] // k_BGLd.shape[1]
        dtype = lse_BGrT.dtype
        q_BGrTd = q_BHTd.unflatten(1, (G, r))
        do_BGrTe = dout_BHTe.unflatten(1, (G, r)).to(dtype)
        delta_BGrT = (do_BGrTe * out_BHTe.unflatten(1, (G, r)).to(dtype)).sum(-1)
        dq_BGrTd = torch.zeros(q_BGrTd.shape, dtype=dtype, device=q_BHTd.device)
        dk_BGLd = torch.zeros(k_BGLd.shape, dtype=dtype, device=k_BGLd.device)
        dv_BGLe = torch.zeros(v_BGLe.shape, dtype=dtype, device=v_BGLe.device)
        for q0, t in _tiles(q_BHTd.shape[2], tile):
            q_t = q_BGrTd.narrow(3, q0, t).to(dtype)
            do_t = do_BGrTe.narrow(3, q0, t)
            lse_t = lse_BGrT.narrow(3, q0, t).unsqueeze(-1)
            delta_t = delta_BGrT.narrow(3, q0, t).unsqueeze(-1)
            dq_t = dq_BGrTd.narrow(3, q0, t)
            for k0, l in _key_tiles(q0, t, start, tile):
                k_l = k_BGLd.narrow(2, k0, l).to(dtype)
                v_l = v_BGLe.narrow(2, k0, l).to(dtype)
                p_BGrtl = torch.exp(_scores(q_t, k_l, scale, q0, k0, start) - lse_t)
                dv_BGLe.narrow(2, k0, l).add_(
                    torch.matmul(p_BGrtl.transpose(-1, -2), do_t).sum(2))
                dp_BGrtl = torch.matmul(do_t, v_l.unsqueeze(2).transpose(-1, -2))
                ds_BGrtl = p_BGrtl * (dp_BGrtl - delta_t) * scale
                dq_t.add_(torch.matmul(ds_BGrtl, k_l.unsqueeze(2)))
                dk_BGLd.narrow(2, k0, l).add_(
                    torch.matmul(ds_BGrtl.transpose(-1, -2), q_t).sum(2))
        return (dq_BGrTd.flatten(1, 2).to(q_BHTd.dtype), dk_BGLd.to(k_BGLd.dtype),
                dv_BGLe.to(v_BGLe.dtype), None, None, None)


def causal_tiled_attention(q_BHTd, k_BGLd, v_BGLe, start: int, scale: float | None = None,
                           tile: int | None = None):
    """softmax(q k^T * scale) v of T queries at positions start..start+T-1 over the L = start+T
    keys and values before their end, causal: equal to SDPA's rows start.. of a causal attention
    over L positions, GQA (G < H) and e != d allowed. Saves O(T + L) for backward, not T x L."""
    if k_BGLd.shape[2] != start + q_BHTd.shape[2]:
        raise ValueError(f"{k_BGLd.shape[2]} keys for queries at positions {start}.."
                         f"{start + q_BHTd.shape[2] - 1}: expected {start + q_BHTd.shape[2]}")
    if scale is None:
        scale = q_BHTd.shape[-1] ** -0.5
    return _CausalTiled.apply(q_BHTd, k_BGLd, v_BGLe, start, scale, tile or TILE)
