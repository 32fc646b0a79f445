"""Greedy decoding equals transformers' `generate`, token for token, for tiny random Mixtral,
Qwen3-MoE and DeepSeek-V3 models: loaded with moepar.from_hf, and converted to a moepar
checkpoint and loaded with moepar.load; without an EOS, and with one that ends a row early."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moepar  # noqa: E402
from moepar.hf import hf_to_moepar  # noqa: E402
from test_hf import hf_model  # noqa: E402

NEW = 16


def hf_greedy(model, ids, eos: int | None):
    """transformers' greedy decoding with EOS set explicitly (None: never stops early); finished
    rows are padded with the EOS, as moepar does."""
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NEW, eos_token_id=eos,
                                           pad_token_id=0 if eos is None else eos)
    with torch.no_grad():   # an all-ones mask: a prompt id equal to the pad id is not padding
        return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_greedy_equals_transformers(arch, tmp_path):
    model, path = hf_model(arch, tmp_path)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    want = hf_greedy(model, ids, None)
    assert want.shape == (2, 5 + NEW)
    hf_to_moepar(path, str(tmp_path / "mp"))
    loaded = {"from_hf": moepar.from_hf(path), "load": moepar.load(str(tmp_path / "mp"))}
    for name, lm in loaded.items():
        got = lm.generate(ids, NEW, temperature=0, eos_ids=())
        assert torch.equal(got, want), (name, got, want)
    # An EOS that row 0 produces early: that row stops and is padded; the other runs on until it
    # ends too or the budget is spent (then both stop where transformers stops).
    eos = int(want[0, 5 + 3])
    want_eos = hf_greedy(model, ids, eos)
    assert (want_eos[0, 5 + 3:] == eos).all()         # row 0 ended (at the latest) there
    for name, lm in loaded.items():
        got = lm.generate(ids, NEW, temperature=0, eos_ids=[eos])
        assert torch.equal(got, want_eos), (name, got, want_eos)
