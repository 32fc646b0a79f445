"""The largest pre-softmax logit of each attention head, tracked for MuonClip (train.qk_clip;
moepar.parallel.qkclip rescales W_q and W_k of the heads whose logits grew past tau).

Legend: B batch, H query heads, G key/value heads, S sequence, d head (q.k) dim.
"""

import torch

__all__ = ["track_max_logits"]


@torch.no_grad()
def track_max_logits(module, q_BHSd, k_BGSd, scale: float | None = None, mask_B1SS=None):
    """module.max_logit_H <- max(itself, each head's largest causal logit q.k * scale of this
    forward); nothing when the module tracks nothing (max_logit_H None). `mask_B1SS` (packed
    documents, True: attends) replaces the causal mask, so only logits the softmax sees count.
    One extra q.k^T per layer (B*H*S*S scores), computed only under train.qk_clip."""
    if module.max_logit_H is None:
        return
    heads, kv_heads, seq = q_BHSd.shape[1], k_BGSd.shape[1], q_BHSd.shape[2]
    if kv_heads != heads:
        k_BGSd = k_BGSd.repeat_interleave(heads // kv_heads, dim=1)
    scores_BHSS = (q_BHSd @ k_BGSd.mT) * (q_BHSd.shape[-1] ** -0.5 if scale is None else scale)
    if mask_B1SS is None:
        hidden = torch.ones(seq, seq, dtype=torch.bool, device=q_BHSd.device).triu(1)
    else:
        hidden = ~mask_B1SS
    scores_BHSS.masked_fill_(hidden, float("-inf"))
    seen_H = scores_BHSS.amax(dim=(0, 2, 3)).to(module.max_logit_H.dtype)
    # in place: the same tensor from step to step (a compiled region sees no new attribute)
    torch.maximum(module.max_logit_H, seen_H, out=module.max_logit_H)
