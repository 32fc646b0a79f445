"""KV-cache decoding and sampling against references without a cache: the cached logits equal a
full forward (GQA and MLA, dropless and with a capacity factor), greedy and sampled generation
equal a loop that re-runs the whole sequence every token, the nucleus is the hand-computed one,
EOS ends rows, and the MLA cache holds the latent only."""

import dataclasses

import pytest
import torch

from moepar.infer.generate import LanguageModel, generate, next_token, sampling_probs
from moepar.infer.source import SourceError, dropless
from moepar.layers import ModelConfig, RouterConfig, Transformer

MLA = dict(attention="mla", q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=6, num_kv_heads=4)
ATTENTION = {"gqa": {}, "mla": MLA}


def model(attention="gqa", capacity_factor=None, **extra):
    shape = dict(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_dim=64,
                 moe_ffn_dim=32, num_experts=4, top_k=2, max_seq_len=48, first_k_dense=1,
                 num_shared_experts=1)
    cfg = ModelConfig(**{**shape, **ATTENTION[attention], **extra})
    router = RouterConfig(capacity_factor=capacity_factor)
    return Transformer(cfg, router, seed=3).double().eval()


def ids(batch=2, length=24, seed=1):
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def cached_logits(m, tokens, chunks):
    """Logits of `tokens` fed through a KV cache in pieces of the given lengths."""
    cache, out, start = m.new_cache(), [], 0
    for n in chunks:
        out.append(m(tokens[:, start:start + n], cache=cache)[0])
        start += n
    assert cache.length == start == tokens.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("attention", ATTENTION)
def test_cached_decoding_equals_a_full_forward(attention):
    m, tokens = model(attention), ids()
    with torch.no_grad():
        full = m(tokens)[0]
    for chunks in ([24], [10] + [1] * 14, [5, 3, 1, 7, 8]):
        torch.testing.assert_close(cached_logits(m, tokens, chunks), full, rtol=1e-10,
                                   atol=1e-12, msg=str(chunks))
    # The prefill is the training forward itself (same kernels, same order): bit-identical.
    assert torch.equal(cached_logits(m, tokens, [24]), full)


@pytest.mark.parametrize("attention", ATTENTION)
def test_capacity_factor_decodes_dropless(attention):
    """A model trained with a capacity factor drops tokens in a full forward, depending on the
    whole sequence (later tokens included): a token decoded alone cannot see that. Inference
    routes dropless, and then cached decoding equals the full forward of that dropless model."""
    trained, tokens = model(attention, capacity_factor=1.0), ids()
    with torch.no_grad():
        logits, moe_outputs = trained(tokens)
    assert sum(int(o.stats.num_dropped) for o in moe_outputs) > 0     # capacity does drop here
    inference = model(attention, capacity_factor=1.0)
    for moe in inference.moe_layers():
        moe.router.cfg = dropless(moe.router.cfg)
    with torch.no_grad():
        full, outs = inference(tokens)
    assert sum(int(o.stats.num_dropped) for o in outs) == 0
    assert not torch.allclose(full, logits)     # the dropped tokens changed the trained forward
    torch.testing.assert_close(cached_logits(inference, tokens, [9] + [1] * 15), full,
                               rtol=1e-10, atol=1e-12)


def test_expert_choice_cannot_decode():
    with pytest.raises(SourceError, match="expert-choice routing picks tokens among the whole "
                                          "group.*router.type='topk'"):
        dropless(RouterConfig(type="expert_choice", capacity_factor=1.0))


def test_mla_cache_holds_the_latent_only():
    m = model("mla")
    cache = m.new_cache(30)
    with torch.no_grad():
        m(ids(length=7), cache=cache)
    latent, rope = cache.layers[0].buffers
    assert latent.shape == (2, 30, 12) and rope.shape == (2, 30, 4)   # kv_lora_rank, rope dims
    assert cache.length == 7
    gqa = model("gqa").new_cache(30)
    with torch.no_grad():
        model("gqa")(ids(length=7), cache=gqa)
    assert [tuple(b.shape) for b in gqa.layers[0].buffers] == [(2, 2, 30, 8)] * 2


def naive_generate(m, tokens, steps, temperature, top_p, seed, eos=None):
    """The reference: the whole sequence through the model for every new token (no cache)."""
    gen = torch.Generator().manual_seed(seed)
    done = torch.zeros(tokens.shape[0], dtype=torch.bool)
    for _ in range(steps):
        with torch.no_grad():
            logits = m(tokens)[0][:, -1]
        if temperature == 0:
            token = logits.argmax(-1)
        else:
            token = torch.multinomial(sampling_probs(logits, temperature, top_p), 1,
                                      generator=gen)[:, 0]
        if eos is not None:
            token = torch.where(done, eos, token)
            done |= token == eos
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        if eos is not None and bool(done.all()):
            break
    return tokens


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.2, 0.9)])
def test_generate_equals_the_loop_without_cache(attention, temperature, top_p):
    m, prompt = model(attention), ids(length=6)
    got = generate(m, prompt, 12, temperature, top_p, seed=5)
    assert got.shape == (2, 18) and torch.equal(got[:, :6], prompt)
    assert torch.equal(got, naive_generate(m, prompt, 12, temperature, top_p, seed=5))
    if temperature > 0:   # the seed matters, and fixes the draw
        assert torch.equal(got, generate(m, prompt, 12, temperature, top_p, seed=5))
        assert not torch.equal(got, generate(m, prompt, 12, temperature, top_p, seed=6))


def test_eos_ends_each_row_and_then_the_generation():
    m, prompt = model(), ids(length=6)
    free = generate(m, prompt, 20, 0.0, 1.0)
    eos = int(free[0, 10])        # row 0 ends at its first eos; row 1 may end later or never
    got = generate(m, prompt, 20, 0.0, 1.0, eos_ids=[eos])
    assert torch.equal(got, naive_generate(m, prompt, 20, 0.0, 1.0, 0, eos=eos))
    first = [(row[6:] == eos).nonzero()[0, 0].item() if (row[6:] == eos).any() else None
             for row in free]
    assert first[0] is not None and first[0] <= 4
    for b, f in enumerate(first):
        if f is not None:
            assert (got[b, 6 + f:] == eos).all()       # after the eos: eos padding
            assert torch.equal(got[b, :6 + f], free[b, :6 + f])
    expected_len = 26 if None in first else 6 + max(first) + 1
    assert got.shape[1] == expected_len


def test_nucleus_is_the_smallest_set_reaching_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]], dtype=torch.float64)
    logits = probs.log()
    # sorted 0.5, 0.3 | 0.15, 0.05: the first two hold 0.8 >= 0.79, so the rest go
    kept = sampling_probs(logits, 1.0, 0.79)
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.5, 0.0, 0.3]], dtype=torch.float64))
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0.81),
                               torch.tensor([[0.0, 0.5, 0.15, 0.3]], dtype=torch.float64))
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0.1),          # the top one always
                               torch.tensor([[0.0, 0.5, 0.0, 0.0]], dtype=torch.float64))
    sharp = sampling_probs(logits, 0.5, 1.0)           # temperature 0.5 squares the odds
    torch.testing.assert_close(sharp, probs ** 2 / (probs ** 2).sum())
    assert next_token(logits, 0.0, 1.0).tolist() == [1]
    draws = next_token(logits.expand(4000, 4), 1.0, 0.79, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {1, 3}


def test_bad_requests_are_named():
    m = model()
    with pytest.raises(ValueError, match=r"40 prompt tokens \+ 9 new tokens = 49 exceed "
                                         r"model.max_seq_len=48"):
        generate(m, ids(length=40), 9)
    with pytest.raises(ValueError, match="temperature=-1 must be >= 0"):
        generate(m, ids(), 1, temperature=-1)
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        generate(m, ids(), 1, top_p=0)
    with pytest.raises(ValueError, match=r"outside \[0, model.vocab_size=64\)"):
        generate(m, torch.tensor([[3, 64]]), 1)
    with pytest.raises(ValueError, match="the KV cache holds 4 positions; 3 are used and 2 more"):
        cache = m.new_cache(4)
        with torch.no_grad():
            m(ids(length=3), cache=cache)
            m(ids(length=2), cache=cache)


def test_language_model_api():
    m = model()
    lm = LanguageModel(m)
    tokens = ids(length=5)
    with torch.no_grad():
        assert torch.equal(lm(tokens), m(tokens)[0])
    assert torch.equal(lm.generate(tokens[0].tolist(), 4, temperature=0),
                       generate(m, tokens[:1], 4, 0.0))
    with pytest.raises(ValueError, match="this model has no tokenizer"):
        lm.complete("hello")
    assert dataclasses.replace(RouterConfig(capacity_factor=2.0), capacity_factor=None) == \
        dropless(RouterConfig(capacity_factor=2.0))
