"""The fused linear + cross-entropy (layers/loss.py) against F.cross_entropy of the full logits:
loss and the gradients of the hidden states and head weight in float64 (1e-12), float32 (1e-6)
and bfloat16 (no further from a float64 reference than the unfused bf16 loss, see BF16_*), chunk
sizes that do and do not divide the tokens, tied embeddings through the model; and what it is
for: under bf16 no float32 [tokens, vocab] tensor exists in its forward or backward, and its peak
bytes are a fraction of the unfused loss's.

Targets -100 count for nothing, as F.cross_entropy's ignore_index=-100; a trainer's grad_scale
(the gradient it will send back) gives the gradients formed in forward, checked in backward.
"""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import moepar.layers.loss as fused
from moepar.layers import ModelConfig, RouterConfig, Transformer
from moepar.layers.loss import linear_cross_entropy, linear_cross_entropy_tokens
from moepar.parallel.local_runner import LocalRunner

T, D, V = 37, 16, 50


def _problem(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, dtype=torch.float64, generator=gen)
    w = torch.randn(V, D, dtype=torch.float64, generator=gen) * 0.5
    targets = torch.randint(V, (T,), generator=gen)
    weight = torch.rand(T, dtype=torch.float64, generator=gen)   # d loss / d loss_T ("none")
    return h.to(dtype), w.to(dtype), targets, weight


def _grads(fn, h, w, targets, weight, reduction):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, targets, reduction)
    (loss * weight.to(loss.dtype) if reduction == "none" else loss).sum().backward()
    return loss.detach(), h.grad, w.grad


def _reference(h, w, targets, reduction):
    """The unfused loss as the runners computed it: logits in the compute dtype, then float32 or
    wider, then F.cross_entropy."""
    logits = F.linear(h, w)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                           targets, reduction=reduction)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("chunk", [1, 7, 16, T, 100])     # 7, 16: the last chunk is shorter
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_cross_entropy_of_the_full_logits(dtype, tol, chunk, reduction):
    h, w, targets, weight = _problem(dtype)
    got = _grads(lambda *a: linear_cross_entropy(*a, chunk=chunk), h, w, targets, weight, reduction)
    want = _grads(_reference, h, w, targets, weight, reduction)
    for name, a, b in zip(("loss", "dh", "dw"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item(), msg=name)


# bf16: both losses against float64 maths on the same bf16 inputs. The fused one rounds the same
# logits (one bf16 matmul per chunk) and sums dW's chunks in float32; it may not be further off
# than the unfused loss by more than this factor plus the absolute floor (measured over 5 draws:
# loss and dh as the unfused, dW up to 1.6x its error with 8 chunks).
BF16_FACTOR, BF16_FLOOR = 2.0, 2e-3


@pytest.mark.parametrize("chunk", [5, T])
def test_bfloat16_is_as_close_to_float64_as_the_unfused_loss(chunk):
    h, w, targets, weight = _problem(torch.bfloat16, seed=1)
    exact = _grads(_reference, h.double(), w.double(), targets, weight, "mean")
    fused_out = _grads(lambda *a: linear_cross_entropy(*a, chunk=chunk), h, w, targets, weight,
                       "mean")
    unfused = _grads(_reference, h, w, targets, weight, "mean")
    for name, f, u, e in zip(("loss", "dh", "dw"), fused_out, unfused, exact, strict=True):
        assert f.dtype == u.dtype, name
        scale = e.abs().max().item()
        err_f = (f.double() - e).abs().max().item() / scale
        err_u = (u.double() - e).abs().max().item() / scale
        assert err_f <= BF16_FACTOR * err_u + BF16_FLOOR, (name, err_f, err_u)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_targets_as_cross_entropy_with_ignore_index(reduction):
    """Targets -100 (padding): no loss and no gradient, and the mean divides by the tokens that
    count, in float64 against F.cross_entropy(ignore_index=-100), with and without autograd."""
    h, w, targets, weight = _problem(torch.float64, seed=5)
    targets = targets.masked_fill(torch.arange(T) % 3 == 1, -100)      # 12 of 37 ignored

    def reference(h, w, targets, reduction):
        return F.cross_entropy(F.linear(h, w), targets, reduction=reduction, ignore_index=-100)
    got = _grads(lambda *a: linear_cross_entropy(*a, chunk=7), h, w, targets, weight, reduction)
    want = _grads(reference, h, w, targets, weight, reduction)
    for name, a, b in zip(("loss", "dh", "dw"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    assert (got[1][targets == -100] == 0).all()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, targets, reduction, chunk=7),
                                   want[0], rtol=1e-12, atol=1e-12)


def test_grad_scale_forms_the_gradients_in_forward():
    """With the gradient the trainer will send back (its loss scale / micro-batches), the
    gradients are those of the scaled loss (float64); a non-finite incoming gradient still
    reaches dh (the trainer then skips the step)."""
    h, w, targets, weight = _problem(torch.float64, seed=6)
    got = _grads(lambda h, w, t, r: linear_cross_entropy(h, w, t, r, chunk=7, grad_scale=0.3) * 0.3,
                 h, w, targets, weight, "mean")
    want = _grads(lambda h, w, t, r: _reference(h, w, t, r) * 0.3, h, w, targets, weight, "mean")
    for name, a, b in zip(("loss", "dh", "dw"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)
    h = h.clone().requires_grad_()
    (linear_cross_entropy(h, w, targets, grad_scale=0.3) * float("nan")).backward()
    assert h.grad.isnan().all()


def test_padding_columns_and_a_vocabulary_slice():
    """A slice of the head (rows [10, 30) of a vocabulary of 25, the last 5 padding), combined
    with the other slice by hand, gives the full loss: the vocab-parallel form's maths."""
    h, w, targets, _ = _problem(torch.float64)
    vocab = 25
    w = w[:vocab]
    targets = targets % vocab
    parts = {}

    def keep(tag):
        def combine(lse_T, target_T):
            parts[tag] = (lse_T.clone(), target_T.clone())
            return lse_T, target_T
        return combine

    padded = torch.cat([w[10:], torch.zeros(5, D, dtype=w.dtype)])
    linear_cross_entropy_tokens(h, w[:10], targets, vocab_start=0, vocab_size=vocab,
                                combine=keep(0), chunk=8)
    linear_cross_entropy_tokens(h, padded, targets, vocab_start=10, vocab_size=vocab,
                                combine=keep(1), chunk=8)
    (l0, t0), (l1, t1) = parts[0], parts[1]
    m = torch.maximum(l0, l1)
    loss = m + ((l0 - m).exp() + (l1 - m).exp()).log() - (t0 + t1)
    torch.testing.assert_close(loss, _reference(h, w, targets, "none"), rtol=1e-12, atol=1e-12)


def _tiny(tie: bool, dtype=torch.float64):
    cfg = ModelConfig(vocab_size=V, dim=D, num_layers=2, num_heads=2, num_kv_heads=1, ffn_dim=32,
                      moe_ffn_dim=16, num_experts=4, top_k=2, max_seq_len=16, first_k_dense=1,
                      tie_embeddings=tie)
    torch.manual_seed(0)
    return Transformer(cfg, RouterConfig(capacity_factor=None, z_coeff=1e-3)).to(dtype)


@pytest.mark.parametrize("tie", [False, True])
def test_model_hidden_states_and_head_weight_give_the_logits_loss(tie):
    """Through the model (tied: the head weight is the embedding's, whose gradient also gets the
    lookup's): every parameter's gradient equals the logits loss's in float64."""
    gen = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(V, (2, 2, 12), generator=gen)
    ref_model, model = _tiny(tie), _tiny(tie)
    logits, _ = ref_model(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    (hidden, weight), _ = model(tokens, head_fn=lambda h, w: (h, w))
    assert hidden.shape == (2, 12, D)
    assert (weight is model.embed.weight) == tie and (weight is model.head_weight)
    loss = linear_cross_entropy(hidden, weight, targets, chunk=5)
    loss.backward()
    want = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-12, atol=1e-14, msg=name)


class _Outputs(TorchDispatchMode):
    """Records (dtype, shape) of every op's outputs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(t.dtype, tuple(t.shape)) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_step_makes_no_float32_tensor_of_all_the_logits(monkeypatch, tie):
    """A bf16 training micro-batch (the runner's forward, loss and backward) forms the logits
    chunk by chunk in bf16 (softmax computes in float32 inside its kernel): nothing float32 with
    a column per id exists at all, and nothing with more rows than a chunk."""
    chunk = 7
    monkeypatch.setattr(fused, "CHUNK_LOGITS", chunk * V)
    model = _tiny(tie, torch.bfloat16)
    runner = LocalRunner(model, 1)
    gen = torch.Generator().manual_seed(4)
    tokens, targets = torch.randint(V, (2, 2, 12), generator=gen)
    with _Outputs() as rec:
        runner.run([tokens], [targets])
    wide = [shape for dtype, shape in rec.seen if dtype == torch.float32 and shape[-1:] == (V,)]
    narrow = [shape for dtype, shape in rec.seen if dtype == torch.bfloat16 and shape[-1:] == (V,)]
    assert (chunk, V) in narrow and (24 - 3 * chunk, V) in narrow   # the chunks, also the last
    # (D, V): the head weight's transposed view inside F.linear
    assert wide == [] and all(s[0] <= chunk or s == (D, V) for s in narrow), sorted(set(narrow))
    assert model.head_weight.grad is None or model.head_weight.grad.dtype == torch.bfloat16


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops create under the mode and are alive at once (freed
    with their storage; no CPU allocation counter exists, and on the meta device nothing is
    allocated at all, so this counts what a GPU would hold)."""

    def __init__(self):
        super().__init__()
        self.live, self.total, self.peak = {}, 0, 0

    def _free(self, key):
        self.total -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.live:
                    self.live[id(storage)] = storage.nbytes()
                    self.total += storage.nbytes()
                    weakref.finalize(storage, self._free, id(storage))
        self.peak = max(self.peak, self.total)
        return out


def loss_peak_bytes(tokens: int, dim: int, vocab: int, fused_loss: bool, device="meta") -> int:
    """Peak bytes the loss's forward + backward creates in bf16 (h, W and targets exist before;
    their gradients count), the fused loss or the unfused one (bf16 logits, float32 copy,
    F.cross_entropy)."""
    h = torch.zeros(tokens, dim, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.zeros(vocab, dim, dtype=torch.bfloat16, device=device, requires_grad=True)
    targets = torch.zeros(tokens, dtype=torch.long, device=device)
    gc.collect()
    gc.disable()
    try:
        with LiveBytes() as meter:
            loss = (linear_cross_entropy(h, w, targets) if fused_loss
                    else _reference(h, w, targets, "mean"))
            loss.backward()
            del loss
    finally:
        gc.enable()
    return meter.peak


def test_fused_loss_peak_bytes_are_a_fraction_of_the_unfused():
    """At 4096 tokens, vocabulary 32000 (chunks of 524 tokens): the unfused loss holds the bf16
    logits, their float32 copy and gradients ([T, V] each); the fused one a chunk's and the
    gradients of h and W."""
    T_, D_, V_ = 4096, 1024, 32000
    old = loss_peak_bytes(T_, D_, V_, fused_loss=False)
    new = loss_peak_bytes(T_, D_, V_, fused_loss=True)
    assert old >= 3 * T_ * V_ * 4                       # [T, V] float32 several times over
    chunk = fused.chunk_tokens(V_)
    # dh, dW in bf16, dW's float32 sum and one chunk's product, a chunk's logits (bf16, float32)
    bound = T_ * D_ * 2 + V_ * D_ * (2 + 4 + 2) + chunk * V_ * (2 + 4) * 2
    assert new <= bound and new < old / 4, (new, old, bound)
