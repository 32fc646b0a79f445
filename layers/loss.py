"""The training loss straight from the final hidden states and the LM head's weight, chunked over
tokens, so that no [tokens, vocab] logits ever exist at once.

Legend: T tokens, D model dim, V vocabulary, Vl the vocabulary columns this call holds (all V on
one device; V/tp under vocabulary parallelism, parallel/vocab.py), C tokens per chunk.

Each chunk's logits are computed in the compute dtype (the weight's, or autocast's), then their
max, sum of exponentials and target logit in float32 or wider (fp32 only per chunk, [C, Vl]);
what outlives a chunk is three [T] vectors. `combine` turns those into each token's logsumexp:
here, locally; under tp, with two all-reduces over the ranks' vocabulary slices (one of the
maxima, one of the sums), once per call on [T] vectors, not per chunk.

Forward saves only h_TD and W_VlD (alive anyway: the head's input and a parameter) and the [T]
logsumexp; backward recomputes each chunk's logits (one more [C, D] x [D, Vl] matmul per chunk)
to form softmax - onehot and the chunk's dh and its share of dW. The alternative, computing the
gradients eagerly in forward (Liger-Kernel's FusedLinearCrossEntropy), saves that matmul but
holds dh_TD and a float32 dW_VlD accumulator from forward to backward (2 GiB at V=128k, D=4096,
at the activation peak), does the gradient work in evaluation too, and under tp needs the
all-reduced logsumexp before any gradient (a second pass or per-chunk collectives).

dW sums over chunks: in float32 under a 16-bit compute dtype (each chunk's product rounded once to
the compute dtype, as the unchunked matmul's one rounding), in place in the weight's dtype else.
"""

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_LOGITS", "chunk_tokens", "local_logsumexp", "linear_cross_entropy_tokens",
           "linear_cross_entropy"]

# Logits per chunk: 2^24 (64 MiB in float32): at V=32000, 524 tokens a chunk.
CHUNK_LOGITS = 1 << 24


def chunk_tokens(num_columns: int, budget: int | None = None) -> int:
    """Tokens per chunk so that a chunk's [C, Vl] logits hold at most `budget` (CHUNK_LOGITS)."""
    return max(1, (CHUNK_LOGITS if budget is None else budget) // max(num_columns, 1))


def local_logsumexp(max_T, sumexp_T, target_T):
    """combine() on one device: (logsumexp, target logit) of each token."""
    return max_T + sumexp_T.log(), target_T


def _compute_dtype(h_TD, w_VD):
    # The matmul's dtype: autocast's when it is on (train.fp32_residual: a float32 hidden state
    # meets bf16 compute weights, as F.linear would under autocast), else the weight's.
    device = h_TD.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return w_VD.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss logsumexp(h W^T) - (h W^T)[target], chunk by chunk (see the module text)."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, vocab_start: int, vocab_size: int, chunk: int,
                dtype, combine):
        T, Vl = h_TD.shape[0], w_VD.shape[0]
        wide = torch.promote_types(dtype, torch.float32)
        w_c = w_VD.to(dtype)
        local_T = targets_T - vocab_start
        mine_T = (local_T >= 0) & (local_T < Vl)
        local_T = local_T.where(mine_T, 0)
        # Columns past the vocabulary (padding of the last tp rank) take no probability mass.
        padding = vocab_start + Vl > vocab_size
        pad_V = (torch.arange(vocab_start, vocab_start + Vl, device=h_TD.device) >= vocab_size
                 if padding else None)
        max_T = torch.empty(T, dtype=wide, device=h_TD.device)
        sumexp_T, target_T = torch.empty_like(max_T), torch.empty_like(max_T)
        for start in range(0, T, chunk):
            rows = slice(start, min(start + chunk, T))
            z_CV = _chunk_logits(h_TD[rows], w_c, wide, pad_V)
            target_T[rows] = z_CV.gather(1, local_T[rows, None]).squeeze(1).where(mine_T[rows], 0.0)
            m_C = z_CV.amax(-1)
            if padding:   # a slice of padding only: max -inf; any finite value makes exp() 0
                m_C = m_C.clamp_min(torch.finfo(wide).min)
            max_T[rows] = m_C
            sumexp_T[rows] = z_CV.sub_(m_C[:, None]).exp_().sum(-1)
            del z_CV
        lse_T, target_T = combine(max_T, sumexp_T, target_T)
        ctx.save_for_backward(h_TD, w_VD, lse_T, local_T, mine_T)
        ctx.chunk, ctx.dtype, ctx.pad_V = chunk, dtype, pad_V
        return lse_T - target_T

    @staticmethod
    def backward(ctx, grad_T):
        h_TD, w_VD, lse_T, local_T, mine_T = ctx.saved_tensors
        T, chunk, dtype = h_TD.shape[0], ctx.chunk, ctx.dtype
        wide = lse_T.dtype
        w_c = w_VD.to(dtype)
        need_h, need_w = ctx.needs_input_grad[:2]
        dh_TD = torch.empty_like(h_TD) if need_h else None
        # 16-bit compute: the chunks' products summed in float32 (see the module text).
        dw_VD = (torch.zeros(w_VD.shape, dtype=torch.promote_types(dtype, torch.float32),
                             device=w_VD.device) if need_w else None)
        grad_T = grad_T.to(wide)
        for start in range(0, T, chunk):
            rows = slice(start, min(start + chunk, T))
            h_c = h_TD[rows].to(dtype)
            # softmax - onehot, scaled by the incoming gradient, in float32 or wider
            p_CV = _chunk_logits(h_c, w_c, wide, ctx.pad_V).sub_(lse_T[rows, None]).exp_()
            ids_C = torch.arange(p_CV.shape[0], device=p_CV.device)
            p_CV.index_put_((ids_C, local_T[rows]), -mine_T[rows].to(wide), accumulate=True)
            g_CV = p_CV.mul_(grad_T[rows, None]).to(dtype)
            del p_CV
            if need_h:
                dh_TD[rows] = g_CV @ w_c
            if need_w:
                if dw_VD.dtype == dtype:
                    dw_VD.addmm_(g_CV.t(), h_c)
                else:
                    dw_VD += g_CV.t() @ h_c
        return (dh_TD, None if dw_VD is None else dw_VD.to(w_VD.dtype),
                None, None, None, None, None, None)


def _chunk_logits(h_CD, w_c, wide, pad_V):
    """A chunk's logits in the compute dtype, widened (a fresh tensor: callers work in place)."""
    z_CV = F.linear(h_CD.to(w_c.dtype), w_c)
    z_CV = z_CV.to(wide) if z_CV.dtype != wide else z_CV
    return z_CV.masked_fill_(pad_V, float("-inf")) if pad_V is not None else z_CV


def linear_cross_entropy_tokens(h_TD, w_VlD, targets_T, *, vocab_start: int = 0,
                                vocab_size: int | None = None, combine=local_logsumexp,
                                chunk: int | None = None):
    """Per-token cross-entropy [T] (float32 or wider) of logits h_TD @ w_VlD.T without forming
    them: `w_VlD` holds vocabulary rows [vocab_start, vocab_start + Vl) of `vocab_size`
    (defaults: all of it); `combine(max_T, sumexp_T, target_T) -> (logsumexp_T, target_T)` joins
    the slices (local_logsumexp on one device); `chunk`: tokens per chunk (default from
    CHUNK_LOGITS). No host sync."""
    Vl = w_VlD.shape[0]
    vocab_size = vocab_start + Vl if vocab_size is None else vocab_size
    chunk = chunk or chunk_tokens(Vl)
    return _LinearCrossEntropy.apply(h_TD, w_VlD, targets_T, vocab_start, vocab_size, chunk,
                                     _compute_dtype(h_TD, w_VlD), combine)


def linear_cross_entropy(h, w_VD, targets, reduction: str = "mean", chunk: int | None = None,
                         ignore_index: int = -100):
    """F.cross_entropy(F.linear(h, w_VD), targets) in float32 or wider, without [tokens, V]
    logits: h [..., D] (after the final norm), targets [...]; `reduction` "mean", "sum" or
    "none". Targets equal to `ignore_index` count for nothing (0 in "none"; "mean" divides by
    the counted tokens), as in F.cross_entropy."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
    counted = targets.reshape(-1) != ignore_index
    loss_T = linear_cross_entropy_tokens(h.reshape(-1, h.shape[-1]), w_VD, targets.reshape(-1),
                                         chunk=chunk).where(counted, 0.0)
    if reduction == "mean":
        return loss_T.sum() / counted.sum()
    return loss_T.sum() if reduction == "sum" else loss_T.view(targets.shape)
