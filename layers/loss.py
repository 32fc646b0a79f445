"""The training loss straight from the final hidden states and the LM head's weight, chunked over
tokens, so that no [tokens, vocab] logits ever exist at once.

Legend: T tokens, D model dim, V vocabulary, Vl the vocabulary columns this call holds (all V on
one device; V/tp under vocabulary parallelism, parallel/vocab.py), C tokens per chunk.

Per chunk, the logits z_CV come from one matmul in the compute dtype (the weight's, or
autocast's) and pass through one softmax kernel in that dtype (float32 accumulation inside the
kernel, one rounding of p on the way out): p = softmax(z) is then both the loss's and the
gradient's source, and nothing [C, V] is float32 under a 16-bit compute dtype. Each token's
logsumexp comes from p's largest entry (one more read of p): lse = z_j - log p_j at j = argmax p,
where p_j >= 1/V, so neither underflow nor the target's own small probability limits it; its
error is p's rounding (relative 2^-8 in bf16: at most 0.004 nats per token; float32 and float64
at their own rounding). What outlives a chunk is [T] vectors.

Two ways to the gradients, chosen at the call (see `linear_cross_entropy`):
- A mean or sum over the whole vocabulary on one device, with gradients wanted (training at
  tp 1): each chunk's softmax - onehot is the logits' gradient at once, so forward forms the
  chunk's dh and its share of dW right away (Liger-Kernel's FusedLinearCrossEntropy): three
  vocabulary-sized matmuls, as unfused logits take, not four. The per-token scale (the
  reduction's 1/count and the caller's `grad_scale`) is applied to [C, D] rows (dh, and h before
  the dW matmul), never to a [C, V] or [V, D] tensor. When the trainer passes the gradient it
  will send back (`grad_scale`: the runners then backpropagate exactly that), backward returns
  dW as it is and scales dh ([T, D]) by the incoming gradient / grad_scale (1 in training; a
  non-finite loss gradient still makes a non-finite step, which the trainer skips); without
  it, backward multiplies both by the incoming gradient (a [V, D] pass per call).
  What this holds from forward to backward is dh_TD and dW_VD in the compute dtype; the loss is
  the last op of the forward, so its backward comes next.
- A slice of the vocabulary (tp), per-token losses, or no gradients (evaluation): forward saves
  only h_TD and W_VlD (alive anyway) and [T] vectors; `combine` joins the slices' logsumexps
  (here: nothing to do; under tp, two all-reduces on [T] vectors once per call); backward
  recomputes each chunk's logits and softmax (a fourth matmul), rescales p by
  exp(lse_local - lse) under tp, and forms dh and dW as above.

dW sums over chunks in the compute dtype, in place (addmm_: each chunk's product added in float32
inside the matmul and rounded once to bf16 under a 16-bit dtype, as Liger-Kernel does by default):
no float32 [V, D] accumulator and no per-step cast. Targets equal to IGNORE_INDEX (-100) count for
nothing: zero loss and gradient, and a mean divides by the tokens that count (0 if none do, where
F.cross_entropy gives nan).
"""

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_LOGITS", "IGNORE_INDEX", "chunk_tokens", "local_logsumexp",
           "linear_cross_entropy_tokens", "linear_cross_entropy", "reduce_tokens"]

# Logits per chunk: 2^24 (32 MiB in bf16): at V=32000, 524 tokens a chunk.
CHUNK_LOGITS = 1 << 24
IGNORE_INDEX = -100     # F.cross_entropy's default: padding targets that count for nothing


def chunk_tokens(num_columns: int, budget: int | None = None) -> int:
    """Tokens per chunk so that a chunk's [C, Vl] logits hold at most `budget` (CHUNK_LOGITS)."""
    return max(1, (CHUNK_LOGITS if budget is None else budget) // max(num_columns, 1))


def local_logsumexp(lse_T, target_T):
    """combine() on one device: the slice is the whole vocabulary."""
    return lse_T, target_T


def _compute_dtype(h_TD, w_VD):
    # The matmul's dtype: autocast's when it is on (train.fp32_residual: a float32 hidden state
    # meets bf16 compute weights, as F.linear would under autocast), else the weight's.
    device = h_TD.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return w_VD.dtype


def _chunk_softmax(h_CD, w_c, wide, lse: bool = True):
    """A chunk's logits z and softmax p in the compute dtype (one softmax kernel), and its
    logsumexp in `wide` from p's largest entry (see the module text) when `lse`."""
    z_CV = F.linear(h_CD.to(w_c.dtype), w_c)
    p_CV = torch.softmax(z_CV, -1)
    if not lse:
        return z_CV, p_CV, None
    p_max, j_C = p_CV.max(-1)
    return z_CV, p_CV, z_CV.gather(1, j_C[:, None]).squeeze(1).to(wide) - p_max.to(wide).log()


def _chunk_grads(g_CV, h_CD, w_c, scale_C, dh_CD, dw_VD, first: bool):
    """dh = (g W) * scale and dW += g^T (h * scale) for g = softmax - onehot in the compute dtype;
    the per-token scale (float32 or wider) is applied to [C, D] rows, each product rounded once."""
    scale_C1 = scale_C[:, None]
    if dh_CD is not None:
        torch.mul(g_CV @ w_c, scale_C1, out=dh_CD)
    if dw_VD is not None:
        hs_CD = torch.mul(h_CD, scale_C1, out=torch.empty_like(h_CD))
        if first:
            torch.mm(g_CV.t(), hs_CD, out=dw_VD)
        else:
            dw_VD.addmm_(g_CV.t(), hs_CD)


def _onehot_(p_CV, t_C, value_C):
    """p[c, t_c] += value_c in place (only C elements touched)."""
    ids_C = torch.arange(p_CV.shape[0], device=p_CV.device)
    return p_CV.index_put_((ids_C, t_C), value_C.to(p_CV.dtype), accumulate=True)


def _local_targets(targets_T, vocab_start: int, num_real: int):
    """(this slice's column of each target, 0 where another slice holds it; which it holds)."""
    local_T = targets_T - vocab_start
    mine_T = (targets_T != IGNORE_INDEX) & (local_T >= 0) & (local_T < num_real)
    return local_T.where(mine_T, 0), mine_T


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss logsumexp(h W^T) - (h W^T)[target] (0 for ignored targets), chunk by chunk,
    the gradients recomputed in backward (see the module text)."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, vocab_start: int, vocab_size: int, chunk: int,
                dtype, combine):
        T, Vl = h_TD.shape[0], w_VD.shape[0]
        wide = torch.promote_types(dtype, torch.float32)
        # Columns past the vocabulary (padding of the last tp rank) are left out of the matmul.
        num_real = max(0, min(Vl, vocab_size - vocab_start))
        w_c = w_VD[:num_real].to(dtype)
        local_T, mine_T = _local_targets(targets_T, vocab_start, num_real)
        lse_T = torch.full((T,), float("-inf"), dtype=wide, device=h_TD.device)
        target_T = torch.zeros_like(lse_T)
        for start in range(0, T if num_real else 0, chunk):
            rows = slice(start, min(start + chunk, T))
            z_CV, _, lse_T[rows] = _chunk_softmax(h_TD[rows], w_c, wide)
            target_T[rows] = z_CV.gather(1, local_T[rows, None]).squeeze(1).to(wide).where(
                mine_T[rows], 0.0)
            del z_CV
        local_lse_T = lse_T
        lse_T, target_T = combine(local_lse_T, target_T)
        counted_T = targets_T != IGNORE_INDEX
        ctx.save_for_backward(h_TD, w_VD, lse_T, local_lse_T, local_T, mine_T, counted_T)
        ctx.chunk, ctx.dtype, ctx.num_real = chunk, dtype, num_real
        ctx.sliced = combine is not local_logsumexp
        return (lse_T - target_T).where(counted_T, 0.0)

    @staticmethod
    def backward(ctx, grad_T):
        h_TD, w_VD, lse_T, local_lse_T, local_T, mine_T, counted_T = ctx.saved_tensors
        T, chunk, dtype, num_real = h_TD.shape[0], ctx.chunk, ctx.dtype, ctx.num_real
        w_c = w_VD[:num_real].to(dtype)
        need_h, need_w = ctx.needs_input_grad[:2]
        dh_TD = (torch.empty_like(h_TD) if num_real else torch.zeros_like(h_TD)) if need_h else None
        dw_VD = torch.empty(w_VD.shape, dtype=dtype, device=w_VD.device) if need_w else None
        if need_w:
            dw_VD[num_real:].zero_()                  # padding rows: no gradient
        scale_T = grad_T.to(lse_T.dtype).where(counted_T, 0.0)
        for start in range(0, T if num_real else 0, chunk):
            rows = slice(start, min(start + chunk, T))
            _, p_CV, _ = _chunk_softmax(h_TD[rows], w_c, lse_T.dtype, lse=False)
            if ctx.sliced:      # this slice's softmax -> the whole vocabulary's
                torch.mul(p_CV, (local_lse_T[rows] - lse_T[rows]).exp()[:, None], out=p_CV)
            _onehot_(p_CV, local_T[rows], -mine_T[rows].to(lse_T.dtype))
            _chunk_grads(p_CV, h_TD[rows].to(dtype), w_c, scale_T[rows],
                         None if dh_TD is None else dh_TD[rows],
                         None if dw_VD is None else dw_VD[:num_real], start == 0)
        return (dh_TD, None if dw_VD is None else dw_VD.to(w_VD.dtype),
                None, None, None, None, None, None)


class _LinearCrossEntropyGrads(torch.autograd.Function):
    """sum over tokens of weight_T * (logsumexp(h W^T) - (h W^T)[target]), one device, the whole
    vocabulary, dh and dW formed in forward for the gradient `grad_scale` (see the module text)."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, weight_T, chunk: int, dtype, grad_scale):
        T = h_TD.shape[0]
        wide = weight_T.dtype
        w_c = w_VD.to(dtype)
        need_h, need_w = ctx.needs_input_grad[:2]
        dh_TD = torch.empty_like(h_TD) if need_h else None
        dw_VD = torch.empty(w_VD.shape, dtype=dtype, device=w_VD.device) if need_w else None
        t_T = targets_T.where(targets_T != IGNORE_INDEX, 0)
        scale_T = weight_T * (1.0 if grad_scale is None else grad_scale)
        loss_T = torch.empty(T, dtype=wide, device=h_TD.device)
        for start in range(0, T, chunk):
            rows = slice(start, min(start + chunk, T))
            h_c = h_TD[rows].to(dtype)
            z_CV, p_CV, lse_C = _chunk_softmax(h_c, w_c, wide)
            loss_T[rows] = lse_C - z_CV.gather(1, t_T[rows, None]).squeeze(1).to(wide)
            del z_CV
            g_CV = _onehot_(p_CV, t_T[rows], torch.full_like(lse_C, -1.0))   # softmax - onehot
            _chunk_grads(g_CV, h_c, w_c, scale_T[rows],
                         None if dh_TD is None else dh_TD[rows], dw_VD, start == 0)
            del p_CV, g_CV
        ctx.save_for_backward(dh_TD, dw_VD)
        ctx.w_dtype, ctx.grad_scale = w_VD.dtype, grad_scale
        return (loss_T * weight_T).sum()

    @staticmethod
    def backward(ctx, grad):
        dh_TD, dw_VD = ctx.saved_tensors
        # dh ([T, D]: cheap) always takes the incoming gradient's ratio to the announced one (1
        # in training; a non-finite gradient still makes a non-finite step); dW only when none
        # was announced: the runners send back exactly `grad_scale` (the module text).
        ratio = grad if ctx.grad_scale is None else grad / ctx.grad_scale
        dh_TD = None if dh_TD is None else dh_TD.mul_(ratio.to(dh_TD.dtype))
        if ctx.grad_scale is None and dw_VD is not None:
            dw_VD = dw_VD.mul_(grad.to(dw_VD.dtype))
        return (dh_TD, None if dw_VD is None else dw_VD.to(ctx.w_dtype),
                None, None, None, None, None)


def linear_cross_entropy_tokens(h_TD, w_VlD, targets_T, *, vocab_start: int = 0,
                                vocab_size: int | None = None, combine=local_logsumexp,
                                chunk: int | None = None):
    """Per-token cross-entropy [T] (float32 or wider; 0 where the target is IGNORE_INDEX) of
    logits h_TD @ w_VlD.T without forming them: `w_VlD` holds vocabulary rows [vocab_start,
    vocab_start + Vl) of `vocab_size` (defaults: all of it); `combine(lse_T, target_T) ->
    (lse_T, target_T)` joins the slices' logsumexps and target logits (local_logsumexp on one
    device); `chunk`: tokens per chunk (default from CHUNK_LOGITS). No host sync."""
    Vl = w_VlD.shape[0]
    vocab_size = vocab_start + Vl if vocab_size is None else vocab_size
    chunk = chunk or chunk_tokens(Vl)
    return _LinearCrossEntropy.apply(h_TD, w_VlD, targets_T, vocab_start, vocab_size, chunk,
                                     _compute_dtype(h_TD, w_VlD), combine)


def _check_reduction(reduction: str):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'")


def _weights(targets_T, reduction: str, dtype):
    """Per-token weights of a mean or sum: 1 (or 1/count) where the target counts, else 0."""
    counted_T = (targets_T != IGNORE_INDEX).to(dtype)
    return counted_T / counted_T.sum().clamp_min(1) if reduction == "mean" else counted_T


def reduce_tokens(loss_T, targets, reduction: str):
    """Per-token losses (0 where ignored) -> `reduction` of them; a mean over counted tokens."""
    if reduction == "none":
        return loss_T.view(targets.shape)
    return (loss_T * _weights(targets.reshape(-1), reduction, loss_T.dtype)).sum()


def linear_cross_entropy(h, w_VD, targets, reduction: str = "mean", chunk: int | None = None,
                         grad_scale: float | None = None):
    """F.cross_entropy(F.linear(h, w_VD), targets, ignore_index=-100) in float32 or wider, without
    [tokens, V] logits: h [..., D] (after the final norm), targets [...]; `reduction` "mean",
    "sum" or "none". `grad_scale`: the gradient the caller will backpropagate into this loss (the
    trainer's loss scale / micro-batches); given, a mean or sum forms W's gradient in forward for
    exactly that gradient and needs no [V, D] pass in backward (see the module text)."""
    _check_reduction(reduction)
    h_TD, targets_T = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    dtype = _compute_dtype(h_TD, w_VD)
    if reduction != "none" and torch.is_grad_enabled() and (h.requires_grad or w_VD.requires_grad):
        weight_T = _weights(targets_T, reduction, torch.promote_types(dtype, torch.float32))
        return _LinearCrossEntropyGrads.apply(h_TD, w_VD, targets_T, weight_T,
                                              chunk or chunk_tokens(w_VD.shape[0]), dtype,
                                              grad_scale)
    return reduce_tokens(linear_cross_entropy_tokens(h_TD, w_VD, targets_T, chunk=chunk), targets,
                         reduction)
