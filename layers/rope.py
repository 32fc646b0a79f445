"""RMSNorm and rotary position embeddings (rotate-half form, optional YaRN context extension),
shared by both attention kinds.

Legend: S sequence, Hd rotary dims per head, F = Hd/2 frequencies.

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension") stretches the low
frequencies by `factor` and keeps the high ones, with a linear ramp between the dims that turn
beta_fast and beta_slow times over the original context; cos and sin are then scaled by an
attention factor. The formulas are transformers' `_compute_yarn_parameters` (rope_type "yarn"),
computed here in float64.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "YaRN", "yarn_mscale", "rope_inv_freq", "rotary_tables", "model_rotary_tables",
           "apply_rotary"]


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YaRN:
    """YaRN parameters; zeros mean "absent", as in a Hugging Face config."""
    factor: float                 # new context length / original context length
    original_max_seq_len: int     # the context length the model was pretrained with
    beta_fast: float = 32.0       # dims turning more often than this over that context: kept
    beta_slow: float = 1.0        # dims turning less often than this: interpolated by factor
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0  # scale on cos and sin; 0 derives it from factor and the mscales
    truncate: bool = True          # round the ramp's ends to whole dims

    @property
    def cos_sin_scale(self) -> float:
        if self.attention_factor:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek's extra factor on the attention softmax scale: mscale(factor, mscale_all_dim)^2
        (1 without mscale_all_dim). Multi-head latent attention applies it; other attention not."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """[F] float64 inverse frequencies."""
        def correction_dim(rotations):   # the dim that turns `rotations` times over the context
            turns = self.original_max_seq_len / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(theta))
        low, high = correction_dim(self.beta_fast or 32), correction_dim(self.beta_slow or 1)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001    # transformers' guard against a zero-width ramp
        ramp_F = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolated_F = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        keep_F = 1 - ramp_F    # 1: the original frequency (fast dims), 0: divided by factor
        return extrapolated_F / self.factor * (1 - keep_F) + extrapolated_F * keep_F


def rope_inv_freq(head_dim: int, theta: float, yarn: YaRN | None = None) -> torch.Tensor:
    """[F] float64 inverse frequencies theta^(-2i/Hd), or YaRN's."""
    if yarn is not None:
        return yarn.inv_freq(head_dim, theta)
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def rotary_tables(seq_len: int, head_dim: int, theta: float, dtype=torch.float64,
                  yarn: YaRN | None = None):
    """cos, sin of shape [S, Hd] for the rotate-half convention (frequencies repeated twice);
    with YaRN, its frequencies and both tables times its attention factor. Always computed on the
    host (also inside a meta-device model build), in float64."""
    with torch.device("cpu"):
        positions_S = torch.arange(seq_len, dtype=torch.float64)
        angles_SF = torch.outer(positions_S, rope_inv_freq(head_dim, theta, yarn))
        angles_SHd = torch.cat([angles_SF, angles_SF], dim=-1)
        scale = yarn.cos_sin_scale if yarn is not None else 1.0
        return (angles_SHd.cos() * scale).to(dtype), (angles_SHd.sin() * scale).to(dtype)


class _Rotary(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]. Saves only cos and sin (the
    tables, in x's dtype): backward is the rotation by -sin, g * cos + R^T (g * sin) with
    R^T [a1, a2] = [a2, -a1]. The same ATen ops, on the same values, as autograd of the plain
    formula, so results are bit-identical to it."""

    @staticmethod
    def forward(ctx, x_BHSd, cos_SHd, sin_SHd):
        ctx.save_for_backward(cos_SHd, sin_SHd)
        x1, x2 = x_BHSd.chunk(2, dim=-1)
        return x_BHSd * cos_SHd + torch.cat([-x2, x1], dim=-1) * sin_SHd

    @staticmethod
    def backward(ctx, grad_BHSd):
        cos_SHd, sin_SHd = ctx.saved_tensors
        g_sin1, g_sin2 = (grad_BHSd * sin_SHd).chunk(2, dim=-1)
        return grad_BHSd * cos_SHd + torch.cat([g_sin2, -g_sin1], dim=-1), None, None


def model_rotary_tables(cfg):
    """(cos, sin) [max_seq_len, rope dim] of a ModelConfig, in float64 on the host: exact for
    float64 models; `.to(dtype)` rounds them once for others."""
    return rotary_tables(cfg.max_seq_len, cfg.rope_dim, cfg.rope_theta, yarn=cfg.yarn)


def apply_rotary(x_BHSd, cos_SHd, sin_SHd):
    """Rotates the last dim of x (rotate-half form) by the tables, cast to x's dtype."""
    cos_SHd, sin_SHd = cos_SHd.to(x_BHSd.dtype), sin_SHd.to(x_BHSd.dtype)
    if cos_SHd.requires_grad or sin_SHd.requires_grad:
        # (tables are buffers; a caller differentiating through them gets plain autograd)
        x1, x2 = x_BHSd.chunk(2, dim=-1)
        return x_BHSd * cos_SHd + torch.cat([-x2, x1], dim=-1) * sin_SHd
    return _Rotary.apply(x_BHSd, cos_SHd, sin_SHd)
