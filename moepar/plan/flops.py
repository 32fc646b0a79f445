"""Forward FLOPs per token of each part of the model (a multiply-add is 2 FLOPs); backward is
twice the forward, recompute adds one forward of what it rebuilds.

Legend: D model dim, S sequence, H/G query/kv heads, d head dim, F dense hidden, Fe expert hidden,
Fs shared hidden, E experts, K top-k, V vocabulary; MLA: Cq/Ckv latent ranks, N/R the no-RoPE and
RoPE parts of a q/k head, Vh the value head dim.

| part             | forward FLOPs per token                                             |
|------------------|---------------------------------------------------------------------|
| GQA projections  | 2 (2 D H d + 2 D G d)                                               |
| MLA projections  | 2 (D Cq + Cq H (N+R) [or D H (N+R)] + D (Ckv+R) + Ckv H (N+V) + H V D) |
| attention core   | causal: 2 * S/2 * H (d_qk + d_v) (scores and values, half the keys)  |
| dense FFN        | 2 * 3 D F (SwiGLU; 2 D F for GELU)                                   |
| router           | 2 D E                                                               |
| routed experts   | per routed row: 2 * 3 D Fe                                          |
| shared experts   | 2 * 3 D Fs                                                          |
| LM head          | 2 D V                                                               |
"""

__all__ = ["attention_flops", "ffn_flops", "expert_row_flops", "moe_token_flops", "head_flops",
           "model_flops_per_token"]


def attention_flops(cfg, seq_len: int) -> tuple[float, float]:
    """(projection FLOPs, attention-core FLOPs) per token."""
    D, H = cfg.dim, cfg.num_heads
    if cfg.attention == "mla":
        N, R, Vh = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        Cq, Ckv = cfg.q_lora_rank, cfg.kv_lora_rank
        q = D * Cq + Cq * H * (N + R) if Cq else D * H * (N + R)
        proj = 2 * (q + D * (Ckv + R) + Ckv * H * (N + Vh) + H * Vh * D)
        core = seq_len * H * (N + R + Vh)
    else:
        d, G = cfg.head_dim_resolved, cfg.num_kv_heads
        proj = 2 * (2 * D * H * d + 2 * D * G * d)
        core = seq_len * H * 2 * d
    return float(proj), float(core)


def _width(cfg) -> int:
    return 3 if cfg.activation == "swiglu" else 2


def ffn_flops(cfg) -> float:
    """The dense FFN of a dense layer."""
    return 2.0 * _width(cfg) * cfg.dim * cfg.ffn_dim


def expert_row_flops(cfg) -> float:
    """One routed row through one expert."""
    return 2.0 * _width(cfg) * cfg.dim * cfg.moe_ffn_dim


def moe_token_flops(cfg) -> float:
    """Router and shared experts, per token (routed experts are counted per row)."""
    shared = cfg.num_shared_experts * (cfg.shared_ffn_dim or cfg.moe_ffn_dim)
    return 2.0 * cfg.dim * cfg.num_experts + 2.0 * _width(cfg) * cfg.dim * shared


def head_flops(cfg) -> float:
    return 2.0 * cfg.dim * cfg.vocab_size


def model_flops_per_token(cfg, seq_len: int) -> float:
    """Forward FLOPs per token of the whole model with perfectly balanced routing: the
    numerator of MFU (times 3 for forward and backward, without recompute)."""
    proj, core = attention_flops(cfg, seq_len)
    total = head_flops(cfg)
    for i in range(cfg.num_layers):
        total += proj + core
        if cfg.is_moe_layer(i):
            total += moe_token_flops(cfg) + cfg.top_k * expert_row_flops(cfg)
        else:
            total += ffn_flops(cfg)
    return total
