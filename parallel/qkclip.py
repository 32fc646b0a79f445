"""MuonClip's QK-clip (Kimi K2, train.qk_clip = tau): after each optimizer step, every attention
head whose largest pre-softmax logit in the step exceeded tau has its query and key weights
scaled by gamma = tau / max, so the same inputs would give logits of at most tau.

Talks on `dp` (one all-reduce MAX of every layer's per-head maxima; tp ranks hold different
heads and pipeline stages different layers, so nothing else). No host sync: gamma stays on the
device.

| attention | rows scaled by                                                                     |
|-----------|------------------------------------------------------------------------------------|
| MHA (G=H) | q rows of head h and k rows of head h: sqrt(gamma_h) each                          |
| GQA (G<H) | q rows of head h: gamma_h (the k rows are shared by several q heads, so untouched) |
| MLA       | head h's no-RoPE q rows and no-RoPE k rows (kv_b_proj): sqrt(gamma_h); its RoPE q  |
|           | rows: gamma_h; the RoPE key shared by all heads (kv_a_proj): untouched (Kimi K2)   |

The scaled tensors are the masters (float32 under bf16 training; the compute weights follow in
the same step); under ZeRO-3 each rank scales the rows of its FSDP2 shard. q/k biases scale with
their rows. The attention modules track the maxima themselves (layers/logits.py) while
`max_logit_H` is a tensor; this file arms them and resets them after each clip.
"""

import torch
import torch.distributed as dist

from moepar.layers.attention import Attention
from moepar.layers.mla import MLA

from .placement import local_tensor
from .shards import fsdp_range

__all__ = ["QKClip"]


def _head_rows(gamma_H, head_parts):
    """[H * sum(n)] row scales: per head, each part (rows, power) repeated, gamma ** power."""
    cols = [gamma_H.pow(power)[:, None].expand(-1, n) for n, power in head_parts]
    return torch.cat(cols, dim=1).reshape(-1)


class QKClip:
    def __init__(self, model, tau: float, masters, dp_group, device):
        self.tau, self.masters, self.dp_group = tau, masters, dp_group
        self.attention = [m for m in model.modules() if isinstance(m, (Attention, MLA))]
        self.device = device
        self.reset()

    def reset(self):
        for m in self.attention:
            if m.max_logit_H is None:
                m.max_logit_H = torch.empty(m.num_heads, dtype=torch.float64, device=self.device)
            m.max_logit_H.fill_(float("-inf"))

    def max_logits(self) -> torch.Tensor:
        """Every local head's maximum over the step and every dp rank (float64, on the device)."""
        flat = torch.cat([m.max_logit_H for m in self.attention]) if self.attention else \
            torch.zeros(0, dtype=torch.float64, device=self.device)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.dp_group)
        return flat

    @torch.no_grad()
    def apply(self):
        """Clips after the optimizer step (before the compute weights are written)."""
        flat = self.max_logits()
        gamma = torch.where(flat > self.tau, self.tau / flat, torch.ones_like(flat))
        start = 0
        for m in self.attention:
            g_H = gamma[start:start + m.num_heads]
            start += m.num_heads
            for linear, scale_R in self._row_scales(m, g_H):
                for p in (linear.weight, getattr(linear, "bias", None)):
                    if p is not None:
                        self._scale_rows(self.masters.master(p), scale_R)
        self.reset()

    @staticmethod
    def _row_scales(m, g_H):
        """[(projection, its rows' scales)] for one attention module (local heads)."""
        if isinstance(m, MLA):
            q_proj = m.q_b_proj if m.q_lora else m.q_proj
            return [(q_proj, _head_rows(g_H, [(m.nope, 0.5), (m.rope, 1.0)])),
                    (m.kv_b_proj, _head_rows(g_H, [(m.nope, 0.5), (m.v_dim, 0.0)]))]
        q, k, v = m.qkv_sizes()
        hd = m.head_dim
        if m.num_kv_heads == m.num_heads:
            rows = [_head_rows(g_H, [(hd, 0.5)]), _head_rows(g_H, [(hd, 0.5)])]
        else:
            rows = [_head_rows(g_H, [(hd, 1.0)]), g_H.new_ones(k)]
        return [(m.qkv_proj, torch.cat(rows + [g_H.new_ones(v)]))]

    @staticmethod
    def _scale_rows(w, scale_R):
        local = local_tensor(w)
        scale_R = scale_R.to(local.dtype)
        if hasattr(w, "placements") and w.placements[0].dim == 0:   # FSDP2: this rank's rows
            mesh = w.device_mesh
            a, b = fsdp_range(w.shape[0], mesh.size(), mesh.get_local_rank())
            scale_R = scale_R[a:b]
        local.mul_(scale_R.view(-1, *([1] * (local.dim() - 1))))
