"""On a GPU: context parallelism's mask-free tiled attention (layers/blockwise.py) against a
float64 causal SDPA on the CPU, forward and backward, GQA and MLA head shapes, fp32 and bf16,
under `torch.cuda.set_sync_debug_mode("error")` (no host sync in its tile loops)."""

import pytest
import torch
import torch.nn.functional as F

from moepar.layers.blockwise import causal_tiled_attention

pytestmark = pytest.mark.cuda

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, qk_dim, v_dim", [(8, 2, 64, 64), (4, 4, 96, 64)],
                         ids=["gqa", "mla"])
def test_tiled_attention_matches_sdpa_without_syncs(dtype, heads, kv_heads, qk_dim, v_dim):
    gen = torch.Generator().manual_seed(0)
    seq, start = 1000, 600              # the last 400 positions, over keys 0..999
    q = torch.randn(2, heads, seq, qk_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, seq, qk_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq, v_dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(2, heads, seq - start, v_dim, generator=gen, dtype=torch.float64)
    # The reference starts from the inputs as rounded to dtype: only the kernel's own error counts.
    ref = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True,
                                          enable_gqa=heads != kv_heads)[:, :, start:]
    want.backward(grad)
    gpu = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = causal_tiled_attention(gpu[0][:, :, start:], gpu[1], gpu[2], start, tile=256)
        out.backward(grad.to("cuda", dtype))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out.double().cpu(), want.detach(), **TOL[dtype])
    for got, r in zip(gpu, ref, strict=True):
        torch.testing.assert_close(got.grad.double().cpu(), r.grad, **TOL[dtype])
