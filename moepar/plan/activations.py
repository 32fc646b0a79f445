"""Bytes autograd keeps for backward, per layer and micro-batch, as moepar's own layers save them:
the planner's activation memory, with the four recompute modes.

Legend: T tokens of a micro-batch on this rank (mbs * S / cp: context parallelism holds S/cp
positions of each sequence), Tk the positions whose keys attention gathers (mbs * S; T at cp = 1),
t = T/tp (sequence-parallel slice), D model dim,
Hl/Gl query/kv heads per tp rank, d head dim, Fl dense hidden per tp rank, Fe expert hidden,
Fs shared hidden, E experts, K top-k, R rows this rank's experts receive, Ns rows it sends,
V (Vl per tp rank) vocabulary; r bytes of the residual stream (the compute dtype under bf16
training, float32 with train.fp32_residual), a bytes of the compute dtype (2 under bfloat16),
f bytes of the float32-or-wider maths (router, losses), p bytes of a master parameter.

| piece (one layer)    | saved                                                                     |
|----------------------|---------------------------------------------------------------------------|
| RMSNorm (t tokens)   | input, rstd (+ the normalized input where the norm is not fused: CPU)     |
| projections' input   | T*D per projection (qkv: 1; MLA q_a, kv_a: 2): autocast casts, or under    |
|                      | tp the row copies of the gathered sequence (one shared when mbs = 1);     |
|                      | once (the norm's output) in float32 at tp = 1                             |
| GQA attention        | roped q (Hl*d), roped k and v (Gl*d, for Tk), output (Hl*d, shared with   |
|                      | o_proj's input), log-sum-exp (Hl, fp32)                                   |
| MLA                  | q_a/kv_a norms and q_b/kv_b inputs (Cq, Ckv), q and k (Hl*(N+R)), kv_b's  |
|                      | output (Hl*(N+V), v is a view of it), output, lse; k, kv_b's input and    |
|                      | output for Tk (cp gathers the latent); on CPU (qk != v dims)              |
|                      | SDPA's math path: probabilities Hl*S per token and a copy of v and of out |
| dense FFN (SwiGLU)   | input D, [gate|up] 2Fl, w_out's input Fl (GELU: 2Fl; silu not kept)      |
| router               | scores, logits and logsumexp (z-loss), top-k ids, norm/sigmoid sums (fp32)|
| dispatch / combine   | slot->row ids t*K, rows' ids Ns (x2), all-to-all permutations R (x2),     |
|                      | un-sorted expert outputs t*K*D and weights t*K (fp32)                     |
| experts (rows R)     | R*(D + 2Fe + Fe) in the compute dtype                                     |
| shared experts       | like a dense FFN on t tokens (+ its input cast and gate under autocast)   |
| compute weights      | not here: bf16 training keeps them between steps (parallel/precision.py), |
|                      | counted with the parameters (memory.py); nothing casts a weight per step  |
| embedding / head     | token ids; final norm, the head's input h (T*D*r), targets and the fused  |
|                      | loss's per-token logsumexp (no logits: layers/loss.py)                    |

Recompute: "full" keeps each block's input only (t*D*r); "attention" keeps the attention
sub-block's input instead of its activations; "experts" keeps the expert rows' input R*D instead
of R*(D + 4Fe) (and no weight copies for them). In backward one region at a time is recomputed:
its full bytes are the recompute working set. The four modes are the trainer's
`train.recompute` (parallel/checkpointing.py).
"""

import dataclasses
from dataclasses import dataclass

__all__ = ["ActSpec", "RECOMPUTE", "layer_bytes", "embed_bytes", "head_bytes", "rows_per_rank"]

RECOMPUTE = ("none", "full", "attention", "experts")


@dataclass(frozen=True)
class ActSpec:
    """What activation bytes depend on besides the model."""
    micro_batch: int
    seq_len: int
    tp: int = 1
    ep: int = 1
    dtype: str = "bfloat16"          # train.dtype
    zero: int = 0
    recompute: str = "none"
    row_factor: float = 1.0          # rows received by the busiest EP rank / (t*K): rows_per_rank
    peak_row_factor: float | None = None  # the same in the busiest layer (default: row_factor)
    kernels: str = "cuda"            # "cuda" or "cpu": which norm and attention kernels run
    fp32_residual: bool = False      # train.fp32_residual
    cp: int = 1                      # context parallel: this rank holds S/cp of each sequence

    @property
    def p(self) -> int:              # a master parameter, its gradient and AdamW moment
        return 8 if self.dtype == "float64" else 4

    @property
    def f(self) -> int:              # float32-or-wider maths: router scores, losses
        return self.p

    @property
    def a(self) -> int:              # matmul inputs and outputs: the compute dtype
        return 2 if self.dtype in ("bfloat16", "float16") else self.p

    @property
    def r(self) -> int:              # the residual stream and the norms' inputs
        return self.p if self.fp32_residual else self.a

    @property
    def autocast(self) -> bool:      # only under fp32_residual: float32 activations at matmuls
        return self.a < self.p and self.fp32_residual

    weight_copies = False            # compute weights are kept between steps, not cast

    @property
    def tokens(self) -> float:       # T
        return self.micro_batch * self.seq_len / self.cp

    @property
    def key_tokens(self) -> int:     # Tk: attention's gathered keys, whole sequences
        return self.micro_batch * self.seq_len

    @property
    def local_tokens(self) -> float:  # t
        return self.tokens / self.tp


def rows_per_rank(ep: int, top_k: int, capacity_factor: float | None, imbalance: float) -> float:
    """Rows the busiest EP rank's experts receive per local token, over top_k: the dispatch
    buffers' factor. Dropless: the imbalance factor (busiest over mean), at most ep (everything on
    one rank). Capacity: at most the capacity factor (each expert keeps C = T*K*cf/E per group).
    On one rank (ep = 1) the rows are the kept copies: 1, or cf when that is below 1."""
    cap = capacity_factor if capacity_factor is not None else float("inf")
    if ep == 1:
        return min(1.0, cap)
    return min(imbalance, cap, float(ep))


def _norm(n: float, width: int, s: ActSpec) -> float:
    """RMSNorm over `width` features of n tokens: the input (residual dtype) and rstd (float32)
    with CUDA's fused kernel; CPU's composite form computes in float32 and keeps the widened
    input and the normalized one."""
    if s.kernels == "cpu":
        return n * (2 * width + 1) * s.f
    return n * (width * s.r + s.f)


def _proj_input(s: ActSpec, consumers: int, D: int) -> float:
    """The saved input of a region's first projections (T*D each copy)."""
    T = s.tokens
    if s.tp > 1:
        # The gathered sequence comes back as a transposed [S, B, D] buffer: each projection's
        # matmul copies it to rows (one shared view when B = 1).
        return (consumers if s.micro_batch > 1 else 1) * T * D * s.a
    if s.autocast:            # autocast caches weights, not activations: one cast per consumer
        return consumers * T * D * s.a
    return T * D * s.r        # the norm's output itself


def _attention(cfg, s: ActSpec) -> tuple[float, float]:
    """(saved bytes, bf16 weight-copy bytes) of one attention sub-block, norm included."""
    D, T, tp, a = cfg.dim, s.tokens, s.tp, s.a
    Hl = cfg.num_heads // tp
    lse = T * Hl * 4
    rope = 4 * s.seq_len / s.cp * cfg.rope_dim * a if s.autocast else 0   # cos/sin cast per call
    Tk = s.key_tokens
    saved = _norm(s.local_tokens, D, s) + rope
    if cfg.attention == "mla":
        N, R, Vh = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        Cq, Ckv = cfg.q_lora_rank, cfg.kv_lora_rank
        saved += _proj_input(s, 2, D)
        if Cq:
            saved += _norm(T, Cq, s) + T * Cq * a
        saved += _norm(T, Ckv, s) + Tk * Ckv * a
        q, k = T * Hl * (N + R) * a, Tk * Hl * (N + R) * a
        if s.kernels == "cpu" and N + R != Vh:     # SDPA's math path (no fused kernel)
            saved += q + k + T * Hl * s.seq_len * a + (Tk + T) * Hl * Vh * a
        else:
            saved += q + k + Tk * Hl * (N + Vh) * a + T * Hl * Vh * a + lse
        weights = (D * Cq + Cq * Hl * (N + R) if Cq else D * Hl * (N + R)) + D * (Ckv + R) \
            + Ckv * Hl * (N + Vh) + Hl * Vh * D
    else:
        d, G = cfg.head_dim_resolved, cfg.num_kv_heads
        Gl = G // tp if G >= tp else 1
        saved += _proj_input(s, 1, D)      # one fused qkv_proj reads the input
        if cfg.qk_norm != "none":
            saved += _norm(T, Hl * d, s) + _norm(T, Gl * d, s)
        saved += T * Hl * d * a * 2 + Tk * Gl * d * a * 2 + lse    # q, out; k, v; lse
        weights = 2 * D * Hl * d + 2 * D * Gl * d
    return saved, weights * a if s.weight_copies else 0


def _ffn(T: float, Fl: int, D: int, activation: str, s: ActSpec) -> float:
    """A SwiGLU (or GELU) FFN's hidden activations and w_out's input, on T tokens (SwiGLU keeps
    [gate|up] and recomputes silu in backward: layers/experts.py)."""
    return T * Fl * s.a * (3 if activation == "swiglu" else 2)


def _router(cfg, router, s: ActSpec) -> float:
    t, E, K, r = s.local_tokens, cfg.num_experts, cfg.top_k, s.f
    out = t * (2 * E + 1) * r + t * K * 8          # scores; logits + lse (z-loss); top-k ids
    if router.norm_topk_prob:
        out += t * (K + 1) * r
    if router.score_func == "sigmoid":
        out += t * r
    return out


def _moe(cfg, router, s: ActSpec) -> dict:
    """One MoE FFN (norm included): saved bytes split into token-sized and row-sized parts."""
    D, t, K, a, r = cfg.dim, s.local_tokens, cfg.top_k, s.a, s.r
    Fe = cfg.moe_ffn_dim
    keep = rows_per_rank(1, K, router.capacity_factor, 1.0)      # sent: kept copies
    sent, rows = t * K * keep, t * K * s.row_factor
    tokens = _norm(t, D, s) + t * D * r + _router(cfg, router, s)
    tokens += t * K * 8 + t * K * D * r + t * K * r + 2 * sent * 8   # slot ids; combine
    experts = rows * D * a + _ffn(rows, Fe, D, cfg.activation, s)
    row_ids = 2 * rows * 8 if s.ep > 1 else 0                  # all-to-all permutations
    weights = 0.0
    width = 3 if cfg.activation == "swiglu" else 2
    El = cfg.num_experts // s.ep
    if cfg.num_shared_experts:
        Fs = cfg.num_shared_experts * (cfg.shared_ffn_dim or Fe)
        tokens += _ffn(t, Fs, D, cfg.activation, s) + (t * D * a if s.autocast else 0)
        weights += width * D * Fs
        if cfg.shared_gate:
            tokens += t * a + t * D * a + (t * D * a if s.autocast else 0)
            weights += D
    expert_weights = El * width * D * Fe
    if not s.weight_copies:
        weights = expert_weights = 0
    return {"tokens": tokens, "experts": experts, "row_ids": row_ids,
            "weights": weights * a, "expert_weights": expert_weights * a}


def layer_bytes(cfg, router, layer: int, s: ActSpec) -> dict:
    """One layer's bytes for one micro-batch under s.recompute:
    saved (kept from forward to backward, token-sized), rows (kept, proportional to the expert
    rows: the MoE dispatch buffers), weights (bf16 copies kept), recompute (the bytes
    recomputing this layer's region needs at once in backward, 0 without recompute), grad (the
    largest gradient buffers its backward holds at once: SwiGLU's halves and their [rows, 2F]
    cat). The last two are for
    one layer at a time, so they take the busiest layer's rows (s.peak_row_factor)."""
    out = _layer(cfg, router, layer, s)
    if s.peak_row_factor is not None and s.peak_row_factor != s.row_factor:
        peak = _layer(cfg, router, layer, dataclasses.replace(
            s, row_factor=s.peak_row_factor, peak_row_factor=None))
        out.update(recompute=peak["recompute"], grad=peak["grad"])
    return out


def _layer(cfg, router, layer: int, s: ActSpec) -> dict:
    D, t = cfg.dim, s.local_tokens
    attn, attn_w = _attention(cfg, s)
    if cfg.is_moe_layer(layer):
        moe = _moe(cfg, router, s)
        ffn, rows = moe["tokens"], moe["experts"] + moe["row_ids"]
        ffn_w, rows_w = moe["weights"], moe["expert_weights"]
        experts_only = moe["experts"]
        # SwiGLU's backward holds its halves' gradients and their [rows, 2F] cat at once
        grad = t * cfg.top_k * s.row_factor * cfg.moe_ffn_dim * s.a * (
            4 if cfg.activation == "swiglu" else 1)
    else:
        Fl = cfg.ffn_dim // s.tp
        ffn = _norm(t, D, s) + _proj_input(s, 1, D) + _ffn(s.tokens, Fl, D, cfg.activation, s)
        width = 3 if cfg.activation == "swiglu" else 2
        ffn_w = width * D * Fl * s.a if s.weight_copies else 0
        rows = rows_w = experts_only = 0
        grad = s.tokens * Fl * s.a * (4 if cfg.activation == "swiglu" else 1)
    block = t * D * s.r
    full = {"saved": attn + ffn, "rows": rows, "weights": attn_w + ffn_w + rows_w}
    if s.recompute == "none":
        return {**full, "recompute": 0.0, "grad": grad}
    if s.recompute == "full":
        return {"saved": block, "rows": 0.0, "weights": 0.0, "recompute": sum(full.values()),
                "grad": grad}
    if s.recompute == "attention":
        return {"saved": block + ffn, "rows": rows, "weights": ffn_w + rows_w,
                "recompute": attn + attn_w, "grad": grad}
    # experts: the grouped GEMMs and their activation keep only their input rows
    kept = rows - experts_only
    if experts_only:
        kept += s.row_factor * t * cfg.top_k * D * s.a
    return {"saved": attn + ffn, "rows": kept, "weights": attn_w + ffn_w,
            "recompute": experts_only + rows_w, "grad": grad}


def embed_bytes(cfg, s: ActSpec) -> float:
    """The embedding (first chunk): token ids (and the vocabulary-parallel mask)."""
    return s.tokens * 8 + (s.tokens * s.r if s.tp > 1 else 0)


def head_bytes(cfg, s: ActSpec) -> dict:
    """The final norm, LM head and loss (last chunk): saved, and its bf16 weight copy. The fused
    loss (layers/loss.py) keeps h_TD as the norm gave it and [T] vectors, never the logits."""
    D, T = cfg.dim, s.tokens
    Vl = -(-cfg.vocab_size // s.tp)
    saved = _norm(s.local_tokens, D, s) + T * D * s.r
    saved += T * (8 + s.f + 8 + 1)         # targets; logsumexp; target's column and owner mask
    return {"saved": saved, "weights": Vl * D * s.a if s.weight_copies else 0.0}
