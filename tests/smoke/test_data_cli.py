"""The README's "Your own data" flows through the real CLI: prepare, train, resume; and a converted
Hugging Face model trained on data prepared with its own tokenizer."""

import gzip
import json
import pathlib
import random
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def moepar(*args):
    return subprocess.run([sys.executable, "-m", "moepar", *args], capture_output=True, text=True,
                          timeout=240)


def losses(run_dir) -> dict[int, float]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def corpus(tmp_path, n=400) -> list[str]:
    rng = random.Random(0)
    words = "the cat sat on a mat and dog ran far away from home with one red ball".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(n)]
    (tmp_path / "book.txt").write_text("\n\n".join(docs[:n // 2]))
    with gzip.open(tmp_path / "web.jsonl.gz", "wt") as f:
        for d in docs[n // 2:]:
            f.write(json.dumps({"text": d, "url": "x"}) + "\n")
    return docs


def test_prepare_train_resume_through_the_cli(tmp_path):
    corpus(tmp_path)
    result = moepar("data", "prepare", "--tokenizer", "bytes", "--input", str(tmp_path / "book.txt"),
                    str(tmp_path / "web.jsonl.gz"), "--split-blank-lines", "--out",
                    str(tmp_path / "data"), "--workers", "2", "--val-fraction", "0.05")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wrote" in result.stdout and "prepare: 100.0%" in result.stderr
    train = ("train", str(ROOT / "examples" / "tiny.toml"), "--data.source=tokens",
             f"--data.path={tmp_path / 'data'}", "--train.steps=4", "--train.warmup_steps=1",
             "--train.seq_len=32", "--train.global_batch_size=4", "--run.checkpoint_every=2",
             "--run.tensorboard=false", f"--run.dir={tmp_path / 'run'}")
    result = moepar(*train)
    assert result.returncode == 0, result.stderr[-3000:]
    straight = losses(tmp_path / "run")
    assert sorted(straight) == [1, 2, 3, 4]
    result = moepar(*train, f"--run.resume_from={tmp_path / 'run' / 'checkpoints' / 'step_2'}",
                    "--run.overwrite=true")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = losses(tmp_path / "run")
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]
    # The same run on other data is refused, naming what differs.
    result = moepar("data", "prepare", "--tokenizer", "bytes", "--input", str(tmp_path / "book.txt"),
                    "--out", str(tmp_path / "other"), "--val-fraction", "0")   # one document
    assert result.returncode == 0, result.stderr[-3000:]
    result = moepar(*train[:3], f"--data.path={tmp_path / 'other'}", *train[4:],
                    "--train.steps=6", "--run.resume=true")
    assert result.returncode != 0
    assert "another dataset than the checkpoint's" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepare_errors_through_the_cli(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    result = moepar("data", "prepare", "--tokenizer", "bytes", "--input", str(tmp_path / "a.jsonl"),
                    "--out", str(tmp_path / "out"), "--workers", "2")
    assert result.returncode == 1
    assert f"moepar data prepare: error: {tmp_path / 'a.jsonl'}:2: no 'text' field" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]
    result = moepar("data", "--help")
    assert result.returncode == 0 and "prepare" in result.stdout


def test_converted_model_trains_on_its_own_tokenizer(tmp_path):
    """HF folder (weights + tokenizer.json) -> moepar convert -> data prepare with the HF folder's
    tokenizer -> moepar train --run.init_from; and a vocabulary that does not fit is refused."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from configs import tiny_mixtral
    docs = corpus(tmp_path)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tiny_mixtral(tmp_path / "hf", vocab_size=32, eos_token_id=2)
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    train = ("train", str(tmp_path / "mp" / "config.toml"), f"--run.init_from={tmp_path / 'mp'}",
             "--data.source=tokens", "--train.steps=2", "--train.seq_len=16",
             "--train.warmup_steps=1", "--run.tensorboard=false")
    steps = [
        ("convert", "--from", "hf", str(tmp_path / "hf"), "--to", "moepar", str(tmp_path / "mp")),
        ("data", "prepare", "--tokenizer", str(tmp_path / "hf"), "--input",
         str(tmp_path / "web.jsonl.gz"), "--out", str(tmp_path / "data")),
        (*train, f"--data.path={tmp_path / 'data'}", f"--run.dir={tmp_path / 'run'}"),
    ]
    for args in steps:
        result = moepar(*args)
        assert result.returncode == 0, (args[:2], result.stderr[-3000:])
    index = json.loads((tmp_path / "data" / "index.json").read_text())
    assert (index["tokenizer"]["eos_id"], index["tokenizer"]["vocab_size"]) == (2, tok.get_vocab_size())
    assert losses(tmp_path / "run").keys() == {1, 2}
    result = moepar("data", "prepare", "--tokenizer", "bytes", "--input",
                    str(tmp_path / "book.txt"), "--out", str(tmp_path / "bytes"), "--val-fraction", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    result = moepar(*train, f"--data.path={tmp_path / 'bytes'}", f"--run.dir={tmp_path / 'run2'}")
    assert result.returncode != 0
    assert "vocabulary of 256 ids, more than model.vocab_size=32" in result.stderr
