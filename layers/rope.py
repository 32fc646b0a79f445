"""RMSNorm and rotary position embeddings (rotate-half form), shared by both attention kinds.

Legend: S sequence, Hd rotary dims per head.
"""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "rotary_tables", "apply_rotary"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # A weight held in lower precision than x (bf16 parameters under ZeRO-3) is widened, so
        # the norm runs fused in x's dtype; otherwise the weight is used as it is.
        weight = self.weight
        if weight.dtype.itemsize < x.dtype.itemsize:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


def rotary_tables(seq_len: int, head_dim: int, theta: float, dtype=torch.float64, device=None):
    """cos, sin of shape [S, Hd] for the rotate-half convention (frequencies repeated twice)."""
    arange = lambda *a: torch.arange(*a, dtype=torch.float64, device=device)  # noqa: E731
    inv_freq = 1.0 / theta ** (arange(0, head_dim, 2) / head_dim)
    angles_SF = torch.outer(arange(seq_len), inv_freq)
    angles_SHd = torch.cat([angles_SF, angles_SF], dim=-1)
    return angles_SHd.cos().to(dtype), angles_SHd.sin().to(dtype)


def apply_rotary(x_BHSd, cos_SHd, sin_SHd):
    x1, x2 = x_BHSd.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_BHSd * cos_SHd.to(x_BHSd.dtype) + rotated * sin_SHd.to(x_BHSd.dtype)
