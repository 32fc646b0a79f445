"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents.

Legend: B batch, S sequence, D model dim, H heads, Cq / Ckv the q and kv latent ranks (C in
shape suffixes: Ckv), N the no-RoPE ("nope") and R the RoPE part of a q/k head, V the value head
dim, L cached positions (decoding).

    q      = q_b(norm(q_a(x)))            [B, S, H, N + R]    (or q_proj(x) when Cq = 0)
    kv, kr = split(kv_a(x))               [B, S, Ckv], [B, S, R]   (kr: one key RoPE part for all heads)
    k, v   = split(kv_b(norm(kv)))        [B, S, H, N], [B, S, H, V]
    attention over [q_nope | rope(q_rot)] . [k_nope | rope(kr)], softmax scale (N + R)^-0.5
    (times mscale(factor, mscale_all_dim)^2 under YaRN, as DeepSeek-V3 does for long contexts)

Decoding with a KV cache keeps the latent (cache.py): new queries attend to the cached
positions in the latent space, the kv_b_proj blocks folded into the query and the output.

RoPE here is the rotate-half form. DeepSeek's checkpoints lay the R rotary dims out in
interleaved pairs; converting them is a fixed permutation of those weight rows
(moepar.hf.names), which leaves every q.k product unchanged.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .cache import LayerCache, causal_mask_TL
from .logits import track_max_logits
from .rope import RMSNorm, apply_rotary

__all__ = ["MLA"]


class MLA(nn.Module):
    def __init__(self, cfg, out_init_std: float):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk_dim = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, 1e-6)   # DeepSeek fixes these eps at 1e-6
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.num_heads * qk_dim, bias=False)
            q_layers = (self.q_a_proj, self.q_b_proj)
        else:
            self.q_proj = nn.Linear(cfg.dim, cfg.num_heads * qk_dim, bias=False)
            q_layers = (self.q_proj,)
        self.kv_a_proj = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.v_dim, cfg.dim, bias=False)
        for lin in q_layers + (self.kv_a_proj, self.kv_b_proj):
            nn.init.normal_(lin.weight, std=cfg.init_std)
        nn.init.normal_(self.o_proj.weight, std=out_init_std)
        self.q_lora = bool(cfg.q_lora_rank)
        yarn = cfg.yarn   # None: SDPA's own (N + R)^-0.5
        self.softmax_scale = qk_dim ** -0.5 * yarn.softmax_scale_factor if yarn else None
        self.max_logit_H = None      # MuonClip's statistic, a tensor under train.qk_clip (logits.py)

    def forward(self, x_BSD, cos_SR, sin_SR, cache: LayerCache | None = None, mask=None):
        """`cache` (decoding): x_BSD holds the S positions after the cached ones, cos/sin are
        theirs; the cache keeps each position's normalised kv latent and rotated key part.
        `mask` [B, 1, S, S] (packed documents, layers/documents.py): in place of causal."""
        batch, seq, _ = x_BSD.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BSD))) if self.q_lora else self.q_proj(x_BSD)
        q_BHSq = q.view(batch, seq, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rot = q_BHSq.split([self.nope, self.rope], dim=-1)
        kv, k_rot = self.kv_a_proj(x_BSD).split([self.kv_a_norm.weight.shape[0], self.rope], dim=-1)
        kv_BSC = self.kv_a_norm(kv)
        k_rot_B1SR = apply_rotary(k_rot.unsqueeze(1), cos_SR, sin_SR)
        q_rot = apply_rotary(q_rot, cos_SR, sin_SR)
        start = 0
        if cache is not None:
            start = cache.length
            kv_BLC, k_rot_BLR = cache.extend(1, kv_BSC, k_rot_B1SR.squeeze(1))
            if start > 0:
                o_BHSV = self._latent_attention(q_nope, q_rot, kv_BLC, k_rot_BLR, start, mask)
                return self.o_proj(o_BHSV.transpose(1, 2).reshape(batch, seq, -1))
        kv_BHSx = self.kv_b_proj(kv_BSC).view(batch, seq, self.num_heads, -1).transpose(1, 2)
        k_nope, v_BHSV = kv_BHSx.split([self.nope, self.v_dim], dim=-1)
        q_BHSq = torch.cat([q_nope, q_rot], dim=-1)
        k_BHSq = torch.cat([k_nope, k_rot_B1SR.expand(-1, self.num_heads, -1, -1)], dim=-1)
        track_max_logits(self, q_BHSq, k_BHSq, self.softmax_scale, mask_B1SS=mask)
        o_BHSV = F.scaled_dot_product_attention(q_BHSq, k_BHSq, v_BHSV, attn_mask=mask,
                                               is_causal=mask is None, scale=self.softmax_scale)
        return self.o_proj(o_BHSV.transpose(1, 2).reshape(batch, seq, -1))

    def _latent_attention(self, q_nope_BHSN, q_rot_BHSR, kv_BLC, k_rot_BLR, start: int,
                          mask_B1SL=None):
        """Attention of S new queries over L cached positions without expanding their keys and
        values: q_nope . (W_k c) = (q_nope W_k) . c, and sum_l p_l (W_v c_l) = W_v (sum_l p_l c_l),
        with W_k, W_v the per-head blocks of kv_b_proj [H, N + V, C]. Returns o [B, H, S, V].
        `mask_B1SL` (documents): who sees whom, in place of causal."""
        w_HxC = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, -1)
        w_k_HNC, w_v_HVC = w_HxC.split([self.nope, self.v_dim], dim=1)
        q_lat_BHSC = torch.einsum("bhsn,hnc->bhsc", q_nope_BHSN, w_k_HNC)
        scores_BHSL = (q_lat_BHSC @ kv_BLC.unsqueeze(1).transpose(-1, -2)
                       + q_rot_BHSR @ k_rot_BLR.unsqueeze(1).transpose(-1, -2))
        scale = self.softmax_scale or (self.nope + self.rope) ** -0.5
        scores_BHSL = scores_BHSL.float() * scale if scores_BHSL.dtype.itemsize < 4 else \
            scores_BHSL * scale
        mask_SL = causal_mask_TL(start, q_nope_BHSN.shape[2], scores_BHSL.device) \
            if mask_B1SL is None else mask_B1SL
        if mask_SL is not None:
            scores_BHSL = scores_BHSL.masked_fill(~mask_SL, float("-inf"))
        probs_BHSL = torch.softmax(scores_BHSL, dim=-1).to(kv_BLC.dtype)
        o_lat_BHSC = probs_BHSL @ kv_BLC.unsqueeze(1)
        return torch.einsum("bhsc,hvc->bhsv", o_lat_BHSC, w_v_HVC)
