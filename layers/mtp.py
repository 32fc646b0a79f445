"""DeepSeek-V3's multi-token prediction (MTP): model.mtp_layers sequential modules, depth k
predicting the token k+1 places past the main model's next token, from the previous depth's
hidden state and the embedding of the token k ahead.

Legend: B batch (sequences), S sequence length, D model dim, V vocabulary, Sk = S - k.

Depth k (1-based), position i < S - k, for token stream x (inputs x_0..x_{S-1}, targets x_1..x_S):

    h_k[i] = block_k(eh_proj_k([enorm_k(E x_{i+k}) ; hnorm_k(h_{k-1}[i])]))   (2D -> D, no bias)
    loss_k = mean_i CE(head(norm_k(h_k[i])), x_{i+k+1})

h_0 is the main model's final-norm output (what the head reads, as vLLM and SGLang feed
DeepSeek-V3's MTP layer); the embedding E and head are the main model's (shared, not copied);
norm_k is HF's `shared_head.norm`. The concatenation puts the embedding first, as the published
`eh_proj` weights expect. Each depth's sequence is k positions shorter (the paper's T - k):
its causal attention never sees a position without a target, and its MoE routes only real rows.
The block is the model's own kind (MLA or GQA attention, MoE when `is_moe_layer(num_layers + k-1)`),
with the model-wide layer id num_layers + k - 1, as HF numbers DeepSeek-V3's MTP layer.

The caller passes an `MTPMicro` holder per micro-batch (as it passes a MicroBalance): the model
files the embedding output in it (a pipeline's first stage, which sends it to the last) and
reads it there, and adds one loss per depth. The caller weights them (train.mtp_coeff / N).
"""

import torch
from torch import nn

from .rope import RMSNorm

__all__ = ["MTPLayer", "MTPMicro", "mtp_forward"]


class MTPMicro:
    """One micro-batch's MTP traffic: `embeds_BSD`, the main model's embedding output (set by the
    model that holds the embedding, or given by the caller on a pipeline's last stage);
    `losses`, one mean cross-entropy per depth, filled by the model that holds the MTP layers."""

    def __init__(self, embeds_BSD: torch.Tensor | None = None):
        self.embeds_BSD = embeds_BSD
        self.losses: list[torch.Tensor] = []


class MTPLayer(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj, a decoder block, and its head norm (HF's
    `shared_head.norm`); the embedding and head weights come from the model."""

    def __init__(self, cfg, router, layer_id: int, block_cls):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block_cls(cfg, router, layer_id)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BSkD, e_BSkD, cos, sin, balance=None):
        """(this depth's hidden states [B, Sk, D] before its norm, MoE output or None)."""
        x_BSkD = self.eh_proj(torch.cat([self.enorm(e_BSkD), self.hnorm(h_BSkD)], dim=-1))
        return self.block(x_BSkD, cos, sin, balance)


def mtp_forward(layers, h0_BSD, embeds_BSD, cos, sin, balance, head_fn, head_weight, mtp):
    """Runs every depth on the final-norm output h0_BSD; appends each depth's head_fn value
    (head_fn(h, w, k): the loss against the targets shifted k more) to `mtp.losses`; returns the
    depths' MoE outputs in layer order."""
    moe_outputs, h_BSD = [], h0_BSD
    S = h0_BSD.shape[1]
    for k, layer in enumerate(layers, start=1):
        h_BSD, moe_out = layer(h_BSD[:, :S - k], embeds_BSD[:, k:], cos[:S - k], sin[:S - k],
                               balance)
        if moe_out is not None:
            moe_outputs.append(moe_out)
        mtp.losses.append(head_fn(layer.norm(h_BSD), head_weight, k))
    return moe_outputs
