"""The tensors of a model config and their shapes, in closed form (no model is built): what the
parameter counts, the dry run and the planner's memory model (moepar/plan/memory.py) read.

Legend: V vocabulary (Vp padded to a multiple of tp), D model dim, H/G query/kv heads, d head
dim, F dense hidden, Fe expert hidden, Fs shared hidden, E experts, L layers; MLA: n/r/v the
no-rope, rope and value head dims, Cq/Ckv the q and kv ranks.

| tensor (per layer)         | elements                               | split over tp            |
|----------------------------|----------------------------------------|--------------------------|
| attn_norm, ffn_norm        | D each                                 | no                       |
| qkv (GQA, fused q; k; v)   | D*(H+2G)*d (+ (H+2G)*d bias)           | by heads; 1 kv head per rank when G < tp |
| o (GQA)                    | D*H*d                                  | by heads                 |
| q/k norms                  | "head": d each; "full": H*d, G*d       | "full" like q and k      |
| MLA q (or q_a, q_a_norm, q_b) | D*H*(n+r) (or D*Cq + Cq + Cq*H*(n+r)) | q_proj / q_b by heads    |
| MLA kv_a, kv_a_norm, kv_b, o | D*(Ckv+r), Ckv, Ckv*H*(n+v), H*v*D     | kv_b and o by heads      |
| dense FFN                  | 3*D*F (SwiGLU), 2*D*F (GELU)           | by hidden units          |
| router                     | E*D                                    | no                       |
| routed experts             | E * 3*D*Fe (SwiGLU)                    | no: E/ep per EP rank     |
| shared experts (+ gate)    | 3*D*Fs (+ D)                           | no                       |
| embedding, head, norm      | V*D, V*D (unless tied), D              | embedding/head: Vp/tp rows |
"""

import math

__all__ = ["tensor_shapes", "param_count"]


def _attention(cfg, tp: int) -> list[tuple[tuple, bool]]:
    """[(local shape, sharded over tp)] of one layer's attention on a tp rank."""
    D, H = cfg.dim, cfg.num_heads
    out = []
    if cfg.attention == "mla":
        n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            out += [((cfg.q_lora_rank, D), False), ((cfg.q_lora_rank,), False),
                    ((H * (n + r) // tp, cfg.q_lora_rank), True)]
        else:
            out += [((H * (n + r) // tp, D), True)]
        out += [((cfg.kv_lora_rank + r, D), False), ((cfg.kv_lora_rank,), False),
                ((H * (n + v) // tp, cfg.kv_lora_rank), True), ((D, H * v // tp), True)]
        return out
    d, G = cfg.head_dim_resolved, cfg.num_kv_heads
    kv_heads = G // tp if G >= tp else 1
    # registration order (gradient buckets follow it): the fused q/k/v weight and its bias, o
    rows = H * d // tp + 2 * kv_heads * d
    out += [((rows, D), True)] + ([((rows,), True)] if cfg.attention_bias else [])
    out += [((D, H * d // tp), True)]
    if cfg.qk_norm == "head":
        out += [((d,), False), ((d,), False)]
    elif cfg.qk_norm == "full":
        out += [((H * d // tp,), True), ((kv_heads * d,), True)]
    return out


def _layer(cfg, i: int, tp: int) -> list[tuple[tuple, str]]:
    """[(local shape, kind)] of block i (a main layer, or an MTP depth's block) on a tp rank."""
    D = cfg.dim
    width = 2 if cfg.activation == "swiglu" else 1
    # in registration order (gradient buckets follow it): norm, attention, norm, FFN
    shapes = [((D,), "dense")]
    shapes += [(s, "dense") for s, _ in _attention(cfg, tp)]
    shapes += [((D,), "dense")]
    if cfg.is_moe_layer(i):
        E, Fe = cfg.num_experts, cfg.moe_ffn_dim
        shapes += [((E, D), "router"), ((E, D, width * Fe), "expert"), ((E, Fe, D), "expert")]
        if cfg.num_shared_experts:
            Fs = cfg.num_shared_experts * (cfg.shared_ffn_dim or Fe)
            shapes += [((width * Fs, D), "dense"), ((D, Fs), "dense")]
            if cfg.shared_gate:
                shapes += [((1, D), "dense")]
    else:
        F = cfg.ffn_dim
        shapes += [((width * F // tp, D), "dense"), ((D, F // tp), "dense")]
    return shapes


def tensor_shapes(cfg, router=None, tp: int = 1) -> dict:
    """{'root' | layer index: [(local shape, kind)]} on a tp rank; kind 'dense', 'router' (dense,
    and float32 whatever the compute dtype) or 'expert' (expert shapes are whole stacks
    [E, ...]; EP divides them). The MTP depths (model.mtp_layers: enorm, hnorm, eh_proj, a
    block, a norm; layers/mtp.py) are with the final norm and head in 'last', where they live."""
    D = cfg.dim
    vocab = -(-cfg.vocab_size // tp)
    out = {"first": [((vocab, D), "dense")],
           "last": [((D,), "dense")] + ([] if cfg.tie_embeddings else [((vocab, D), "dense")])}
    for i in getattr(cfg, "mtp_layer_ids", []):
        out["last"] += [((D,), "dense"), ((D,), "dense"), ((D, 2 * D), "dense")]
        out["last"] += _layer(cfg, i, tp) + [((D,), "dense")]
    for i in range(cfg.num_layers):
        out[i] = _layer(cfg, i, tp)
    return out


def param_count(cfg) -> dict:
    """Whole-model parameter counts: total, dense, expert, and active per token."""
    shapes = tensor_shapes(cfg)
    dense = sum(math.prod(s) for group in shapes.values() for s, kind in group if kind != "expert")
    expert = sum(math.prod(s) for group in shapes.values() for s, kind in group if kind == "expert")
    active = dense + (expert * cfg.top_k // cfg.num_experts if cfg.num_experts else 0)
    return {"total": dense + expert, "dense": dense, "expert": expert, "active": active}
