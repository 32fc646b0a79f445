"""What a SOURCE is and which tokenizer it brings: run directories (newest checkpoint), checkpoints
and HF folders; byte runs decode to text (EOS only where the data has one), prepared folders
bring their tokenizer.json and EOS; a loaded run's logits are the trained model's."""

import json
import os

import pytest
import torch

import moepar
from configs import tiny_config, tiny_mixtral
from moepar.data.prepare import PrepareOptions, prepare
from moepar.infer.source import SourceError, load_tokenizer, resolve_source
from moepar.train import Trainer


def train(tmp_path, name, *overrides) -> Trainer:
    trainer = Trainer(tiny_config(tmp_path / name, "--train.steps=2", "--run.checkpoint_every=1",
                                  *overrides), log=lambda _m: None)
    trainer.run()
    return trainer


def word_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on a mat", "a dog ran far"],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return tok


def prepared(tmp_path, name, tokenizer) -> str:
    (tmp_path / f"{name}.txt").write_text("\n\n".join(["the cat sat on a mat", "a dog ran far"] * 60))
    out = str(tmp_path / name)
    prepare(PrepareOptions(tokenizer=tokenizer, inputs=[str(tmp_path / f"{name}.txt")], out=out,
                           split_blank_lines=True, eos_token=None if tokenizer == "bytes" else "</s>"),
            stderr=open(os.devnull, "w"))
    return out


def test_run_and_checkpoint_sources_load_the_newest_weights(tmp_path):
    trainer = train(tmp_path, "run")
    run = resolve_source(str(tmp_path / "run"))
    assert (run.kind, os.path.basename(run.weights)) == ("run", "step_2")
    step1 = resolve_source(str(tmp_path / "run" / "checkpoints" / "step_1"))
    assert step1.kind == "checkpoint" and step1.run_dir == os.path.abspath(tmp_path / "run")
    lm = moepar.load(str(tmp_path / "run"))
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm(tokens), trainer.model(tokens)[0], rtol=0, atol=0)
    tok = lm.tokenizer
    assert (tok.name, tok.eos_ids) == ("bytes", ())      # builtin data: bytes, no EOS
    assert tok.decode(tok.encode("héllo")) == "héllo"
    text = lm.complete("The ", max_new_tokens=8, temperature=0)
    assert isinstance(text, str) and text == lm.tokenizer.decode(
        lm.generate(torch.tensor([list(b"The ")]), 8, temperature=0)[0, 4:].tolist())


def test_tokenizers_follow_the_training_data(tmp_path):
    byte_run = train(tmp_path, "bytes", "--data.source=tokens",
                     f"--data.path={prepared(tmp_path, 'b', 'bytes')}")
    tok = load_tokenizer(resolve_source(byte_run.cfg.run.dir))
    assert (tok.name, tok.eos_ids) == ("bytes", (255,))      # the prepared folder's EOS
    assert tok.decode([104, 105, 255, 33]) == "hi!"
    vocab = word_tokenizer(tmp_path / "tok")
    words = prepared(tmp_path, "w", str(tmp_path / "tok"))
    word_run = train(tmp_path, "words", "--data.source=tokens", f"--data.path={words}")
    tok = load_tokenizer(resolve_source(word_run.cfg.run.dir))
    assert tok.name == os.path.join(words, "tokenizer.json") and tok.eos_ids == (2,)
    assert tok.encode("the cat") == [vocab.token_to_id("the"), vocab.token_to_id("cat")]  # no BOS
    assert tok.continuation(tok.encode("the cat"), tok.encode("sat")) == " sat"
    assert load_tokenizer(resolve_source(word_run.cfg.run.dir), "bytes").name == "bytes"
    os.rename(words, tmp_path / "moved")
    with pytest.raises(SourceError, match=r"not \(or no longer\) a folder from `moepar data "
                                          r"prepare`.*pass --tokenizer"):
        load_tokenizer(resolve_source(word_run.cfg.run.dir))
    assert moepar.load(word_run.cfg.run.dir).tokenizer is None     # still loads, ids only
    with pytest.raises(ValueError, match="this model has no tokenizer .*no longer"):
        moepar.load(word_run.cfg.run.dir).complete("the cat")


def test_hf_folder_tokenizer_and_eos(tmp_path):
    pytest.importorskip("transformers")
    tiny_mixtral(tmp_path / "hf", vocab_size=16, num_hidden_layers=1, eos_token_id=2)
    lm = moepar.from_hf(str(tmp_path / "hf"))
    assert lm.tokenizer is None and "no tokenizer.json" in lm._tokenizer_error
    word_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    tok = moepar.from_hf(str(tmp_path / "hf")).tokenizer
    assert tok.eos_ids == (2, 1)      # the EOS `data prepare` finds, then generation_config's


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "is not a directory"),
    (lambda p: os.makedirs(p), "is not a run directory .*, a checkpoint .* or a Hugging Face"),
    (lambda p: os.makedirs(os.path.join(p, "checkpoints")), "has no complete checkpoint"),
])
def test_bad_sources_are_named(tmp_path, make, message):
    path = str(tmp_path / "x")
    make(path)
    with pytest.raises(SourceError, match=message):
        resolve_source(path)
