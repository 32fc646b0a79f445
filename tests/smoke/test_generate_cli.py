"""The README's "Evaluate and sample" flows through the real CLI: convert a Hugging Face model
(tokenizer files copied), prepare data with its tokenizer, fine-tune with validation, `moepar eval`
(the figure logged in training), `moepar generate` on the run, the checkpoint and the HF folder
(greedy text equals transformers' generate decoded by the same tokenizer); a byte-level run
samples text."""

import json
import pathlib
import subprocess
import sys

import pytest


def moepar(*args):
    return subprocess.run([sys.executable, "-m", "moepar", *args], capture_output=True, text=True,
                          timeout=240)


def ok(*args) -> str:
    result = moepar(*args)
    assert result.returncode == 0, (args[:2], result.stderr[-3000:])
    return result.stdout


def hf_folder(path: pathlib.Path):
    """A tiny random Mixtral with a word-level tokenizer (EOS </s> = 2); returns both."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from configs import tiny_mixtral
    words = "the cat sat on a mat and dog ran far away from home with one red ball".split()
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>",
                                                                             "</s>"]))
    model = tiny_mixtral(path, vocab_size=32, eos_token_id=2, initializer_range=0.1)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return model, tok, words


def test_convert_prepare_finetune_evaluate_sample(tmp_path):
    import gzip
    import random

    import torch
    model, tok, words = hf_folder(tmp_path / "hf")
    rng = random.Random(0)
    with gzip.open(tmp_path / "web.jsonl.gz", "wt") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(30))}) + "\n")
    ok("convert", "--from", "hf", str(tmp_path / "hf"), "--to", "moepar", str(tmp_path / "mp"))
    manifest = json.loads((tmp_path / "mp" / "manifest.json").read_text())["files"]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(manifest)
    assert (tmp_path / "mp" / "tokenizer.json").read_bytes() == \
        (tmp_path / "hf" / "tokenizer.json").read_bytes()
    ok("data", "prepare", "--tokenizer", str(tmp_path / "mp"), "--input",
       str(tmp_path / "web.jsonl.gz"), "--val-fraction", "0.2", "--out", str(tmp_path / "data"))
    before = json.loads(ok("eval", str(tmp_path / "mp"), "--data", str(tmp_path / "data"),
                           "--train.seq_len=16", "--batches", "2"))
    ok("train", str(tmp_path / "mp" / "config.toml"), f"--run.init_from={tmp_path / 'mp'}",
       "--data.source=tokens", f"--data.path={tmp_path / 'data'}", "--train.steps=2",
       "--train.seq_len=16", "--train.warmup_steps=1", "--train.eval_every=2",
       "--train.eval_batches=2", "--run.tensorboard=false", f"--run.dir={tmp_path / 'run'}")
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [("val_loss" in r) for r in logged] == [False, True]
    result = json.loads(ok("eval", str(tmp_path / "run"), "--data", str(tmp_path / "data")))
    assert result["step"] == 2 and result["micro_batches"] == 4 and result["tokens"] == 4 * 8 * 16
    assert result["val_loss"] == pytest.approx(logged[1]["val_loss"], rel=1e-6)
    assert result["val_ppl"] == pytest.approx(logged[1]["val_ppl"], rel=1e-6)
    assert before["step"] == 0 and before["val_loss"] > result["val_loss"]    # fine-tuning helped
    two = json.loads(ok("eval", str(tmp_path / "run"), "--data", str(tmp_path / "data"),
                        "--nproc", "2", "--parallel.ep=2").splitlines()[-1])
    assert two["layout"].endswith("ep 2") and two["val_loss"] == pytest.approx(
        logged[1]["val_loss"], rel=1e-5)

    # Greedy text from the HF folder and from the converted checkpoint: transformers' own.
    prompt = "the cat sat"
    ids = torch.tensor([tok.encode(prompt).ids])
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, max_new_tokens=10, eos_token_id=2, pad_token_id=2)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    want = tok.decode(out[0].tolist(), skip_special_tokens=True)
    for source in ("hf", "mp"):
        text = ok("generate", str(tmp_path / source), "--prompt", prompt, "--temperature", "0",
                  "--max-new-tokens", "10")
        assert text.rstrip("\n") == want, source
    # The fine-tuned run samples with its data's tokenizer; the CLI prints prompt + completion.
    text = ok("generate", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "6",
              "--seed", "3")
    from moepar import load
    completion = load(str(tmp_path / "run")).complete(prompt, max_new_tokens=6, seed=3)
    assert text.rstrip("\n") == prompt + completion
    assert set(completion.split()) <= set(words)
    result = moepar("eval", str(tmp_path / "hf"), "--data", str(tmp_path / "data"))
    assert result.returncode == 2 and "convert it first" in result.stderr


def test_byte_run_samples_text(tmp_path):
    ok("train", "tiny", "--train.steps=2", "--model.num_layers=2", "--run.tensorboard=false",
       "--run.log_every=0", f"--run.dir={tmp_path / 'run'}")
    result = moepar("generate", str(tmp_path / "run"), "--prompt", "Hello", "--max-new-tokens",
                    "12")
    assert result.returncode == 0, result.stderr[-2000:]
    from moepar import load
    assert result.stdout.rstrip("\n") == "Hello" + load(str(tmp_path / "run")).complete(
        "Hello", max_new_tokens=12)          # the defaults: temperature 0.8, top-p 0.95, seed 0
    assert "tokenizer bytes; 5 prompt + 12 new tokens" in result.stderr
    bad = moepar("generate", str(tmp_path / "nowhere"), "--prompt", "x")
    assert bad.returncode == 1 and "is not a directory" in bad.stderr
    bad = moepar("generate", str(tmp_path / "run"), "--prompt", "x", "--max-new-tokens", "400")
    assert bad.returncode == 1 and "1 prompt tokens + 400 new tokens = 401 exceed model.max_seq_len=128" in bad.stderr
