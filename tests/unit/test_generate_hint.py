"""A Hugging Face folder without tokenizer.json: `moepar generate`'s error names both ways out,
`--tokenizer FILE` and `--tokenizer bytes`, and the second one works on that folder."""

import pytest

from moepar.infer.source import Source, SourceError, load_tokenizer


def test_the_hint_names_tokenizer_bytes_and_it_works(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    source = Source("hf", str(tmp_path), str(tmp_path), None)
    with pytest.raises(SourceError) as info:
        load_tokenizer(source)
    assert "pass --tokenizer FILE (a tokenizer.json or a folder holding one), or --tokenizer " \
           "bytes for a byte-level model" in str(info.value)
    tokenizer = load_tokenizer(source, "bytes")
    assert tokenizer.encode("héllo") == list("héllo".encode())


def test_a_checkpoint_without_data_names_it_too(tmp_path):
    source = Source("checkpoint", str(tmp_path), str(tmp_path), {"model": {}})
    with pytest.raises(SourceError, match="or --tokenizer bytes for a byte-level model"):
        load_tokenizer(source)
