"""Causal grouped-query attention with rotary position embeddings, through SDPA.

Legend: B batch (sequences), S sequence length, D model dim, H query heads, G key/value heads,
Hd head dim.
"""

from torch import nn

from .cache import LayerCache, causal_attention
from .logits import track_max_logits
from .rope import RMSNorm, apply_rotary

__all__ = ["Attention"]


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; optional q/k/v biases and q/k RMSNorm.

    q, k and v come from one fused projection `qkv_proj` (rows [q of H heads; k of G heads; v of
    G heads]): one GEMM reads the input once, and backward runs one input-gradient and one
    weight-gradient GEMM instead of three each. q, k, v are views of its output."""

    def __init__(self, cfg, out_init_std: float):
        """`cfg`: a ModelConfig (layers/model.py)."""
        super().__init__()
        hd = cfg.head_dim_resolved
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        bias = cfg.attention_bias
        self.qkv_proj = nn.Linear(cfg.dim, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.dim, bias=False)
        # Placeholder values: layers/init.py draws the model's weights (Transformer.__init__, or
        # each rank's shards), the q, k and v row blocks each under its own old name.
        nn.init.normal_(self.qkv_proj.weight, std=cfg.init_std)
        if bias:
            nn.init.zeros_(self.qkv_proj.bias)
        nn.init.normal_(self.o_proj.weight, std=out_init_std)
        self.qk_norm = cfg.qk_norm
        self.max_logit_H = None      # MuonClip's statistic, a tensor under train.qk_clip (logits.py)
        if cfg.qk_norm != "none":
            # "head": one weight of head_dim shared by all heads; "full": over all heads' features.
            q_dim, k_dim = (hd, hd) if cfg.qk_norm == "head" else (cfg.num_heads * hd, cfg.num_kv_heads * hd)
            self.q_norm, self.k_norm = RMSNorm(q_dim, cfg.norm_eps), RMSNorm(k_dim, cfg.norm_eps)

    def qkv_sizes(self) -> tuple[int, int, int]:
        """Rows of q, k, v in qkv_proj (local head counts under tensor parallelism)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return q, kv, kv

    def forward(self, x_BSD, cos_SHd, sin_SHd, cache: LayerCache | None = None, mask=None):
        """`cache`: decoding; x_BSD holds the S positions after the cached ones, and cos/sin are
        theirs ([S, Hd], or [B, 1, S, Hd] for positions per row). `mask` [B, 1, S, L] (packed
        documents, layers/documents.py): who sees whom, in place of causal."""
        batch, seq, _ = x_BSD.shape
        q, k, v = self.qkv_proj(x_BSD).split(self.qkv_sizes(), dim=-1)   # views, no copies
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BSHd = q.view(batch, seq, -1, self.head_dim)
        k_BSGd = k.view(batch, seq, -1, self.head_dim)
        if self.qk_norm == "head":
            q_BSHd, k_BSGd = self.q_norm(q_BSHd), self.k_norm(k_BSGd)
        q_BHSd = apply_rotary(q_BSHd.transpose(1, 2), cos_SHd, sin_SHd)
        k_BGSd = apply_rotary(k_BSGd.transpose(1, 2), cos_SHd, sin_SHd)
        v_BGSd = v.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        start = 0
        if cache is not None:   # attend over the cached positions too: k, v [B, G, L, Hd]
            start = cache.length
            k_BGSd, v_BGSd = cache.extend(2, k_BGSd, v_BGSd)
        if start == 0:
            track_max_logits(self, q_BHSd, k_BGSd, mask_B1SS=mask)
        o_BHSd = causal_attention(q_BHSd, k_BGSd, v_BGSd, start, mask_B1TL=mask)
        return self.o_proj(o_BHSd.transpose(1, 2).reshape(batch, seq, -1))
