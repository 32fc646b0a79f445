"""`moepar data prepare` on small corpora: it holds out what the default evaluation reads (the
lowest-hash documents, a function of the text alone) or refuses with flags that then work; the
training error names the fix; --train-tokenizer learns from the training split only; the folder
follows the umask."""

import json
import os
import random
import re

import numpy as np
import pytest
from tokenizers import Tokenizer

from moepar.config import DataConfig, TrainConfig
from moepar.data.bpe import train_bpe
from moepar.data.cli import main
from moepar.data.sources import validation_batches
from moepar.data.split import Reserve, default_val_tokens, doc_hash, seed_key

WORDS = "the cat sat on a mat and dog ran far away from home with one red ball".split()


def corpus(path, n: int, words=(40, 80), seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return docs


def prepare(*args) -> int:
    return main(["prepare", *map(str, args)])


def index_of(folder) -> dict:
    return json.loads((folder / "index.json").read_text())


def test_the_default_is_what_the_default_evaluation_reads():
    t = TrainConfig()
    assert default_val_tokens() == 1 * 16 * 128 + 1 == t.eval_batches * t.global_batch_size * t.seq_len + 1


def test_forty_documents_hold_out_the_default_evaluation(tmp_path, capsys):
    docs = corpus(tmp_path / "c.jsonl", 40)
    assert prepare("--tokenizer", "bytes", "--input", tmp_path / "c.jsonl", "--out",
                   tmp_path / "d", "--workers", "1") == 0
    assert "holding out" in capsys.readouterr().err
    index = index_of(tmp_path / "d")
    threshold = index["split_rule"]["threshold"]
    key = seed_key(0)
    # the split is the hash rule with the recorded threshold, restated here
    val = [d for d in docs if doc_hash(d, key) < threshold]
    assert index["splits"]["val"]["num_documents"] == len(val)
    assert index["splits"]["val"]["num_tokens"] == sum(len(d.encode()) + 1 for d in val)
    # ... and it is the fewest lowest-hash documents that hold the default evaluation
    by_hash = sorted(docs, key=lambda d: doc_hash(d, key))
    assert by_hash[:len(val)] == sorted(val, key=lambda d: doc_hash(d, key))
    assert sum(len(d.encode()) + 1 for d in by_hash[:len(val) - 1]) < default_val_tokens()
    assert index["splits"]["val"]["num_tokens"] >= default_val_tokens()
    t = TrainConfig()
    batches = validation_batches(DataConfig(source="tokens", path=str(tmp_path / "d")),
                                 t.eval_batches, t.global_batch_size, t.seq_len)
    assert [tuple(x.shape) for x, _ in batches] == [(16, 128)]


def test_a_corpus_too_small_is_refused_with_flags_that_work(tmp_path, capsys):
    corpus(tmp_path / "c.jsonl", 40, words=(10, 40))        # about 4,100 bytes
    out = tmp_path / "d"
    assert prepare("--tokenizer", "bytes", "--input", tmp_path / "c.jsonl", "--out", out) == 1
    err = capsys.readouterr().err
    assert "fewer than --val-tokens 2,049" in err and "--val-fraction 0 for no validation" in err
    assert not out.exists()
    suggested = re.search(r"pass --val-tokens (\d+) ", err).group(1)
    assert prepare("--tokenizer", "bytes", "--input", tmp_path / "c.jsonl", "--out", out,
                   "--val-tokens", suggested) == 0
    splits = index_of(out)["splits"]
    assert int(suggested) <= splits["val"]["num_tokens"] <= splits["train"]["num_tokens"]
    assert prepare("--tokenizer", "bytes", "--input", tmp_path / "c.jsonl", "--out", out,
                   "--val-fraction", "0", "--overwrite") == 0
    assert index_of(out)["splits"]["val"]["num_tokens"] == 0


def test_one_text_file_is_refused_with_the_paragraph_flag(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("\n\n".join(corpus(tmp_path / "c.jsonl", 60)))
    assert prepare("--tokenizer", "bytes", "--input", tmp_path / "notes.txt", "--out",
                   tmp_path / "d") == 1
    err = capsys.readouterr().err
    assert "pass --val-fraction 0 for no validation split; with .txt inputs, --split-blank-lines" in err
    assert prepare("--tokenizer", "bytes", "--input", tmp_path / "notes.txt", "--out",
                   tmp_path / "d", "--split-blank-lines") == 0


def test_the_training_error_names_the_flag_that_fixes_it(tmp_path):
    corpus(tmp_path / "c.jsonl", 100)
    folder = tmp_path / "d"
    assert prepare("--tokenizer", "bytes", "--input", tmp_path / "c.jsonl", "--out", folder,
                   "--val-tokens", "300") == 0
    data = DataConfig(source="tokens", path=str(folder))
    with pytest.raises(ValueError) as info:
        validation_batches(data, 2, 16, 128)
    message = str(info.value)
    need = 2 * 16 * 128 + 1
    assert f"`moepar data prepare ... --val-tokens {need} --overwrite`" in message
    holds = (index_of(folder)["splits"]["val"]["num_tokens"] - 1) // 128
    assert f"(it holds {holds}: train.eval_batches x train.global_batch_size of them)" in message
    assert prepare("--tokenizer", "bytes", "--input", tmp_path / "c.jsonl", "--out", folder,
                   "--val-tokens", need, "--overwrite") == 0
    assert len(validation_batches(data, 2, 16, 128)) == 2


def test_the_trained_tokenizer_saw_the_training_split_only(tmp_path, capsys):
    docs = corpus(tmp_path / "c.jsonl", 100, words=(10, 40))
    folder = tmp_path / "d"
    assert prepare("--train-tokenizer", 300, "--input", tmp_path / "c.jsonl", "--out", folder,
                   "--val-tokens", 300) == 0
    assert "trained a byte-level BPE of 300 tokens on the training split" in capsys.readouterr().err
    index = index_of(folder)
    threshold, key = index["split_rule"]["threshold"], seed_key(0)
    train = [d for d in docs if doc_hash(d, key) >= threshold]
    val = [d for d in docs if doc_hash(d, key) < threshold]
    assert len(val) == index["splits"]["val"]["num_documents"] > 0
    saved = json.loads((folder / "tokenizer.json").read_text())

    def trained_on(texts):
        train_bpe(iter(texts), 300, str(tmp_path / "t.json"))
        return json.loads((tmp_path / "t.json").read_text())["model"]
    assert saved["model"] == trained_on(train)
    assert saved["model"] != trained_on(docs)             # the validation documents would show
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    assert index["tokenizer"]["eos_id"] == eos and index["tokenizer"]["vocab_size"] == 300
    want = np.concatenate([np.array(tok.encode(d).ids + [eos]) for d in train])
    assert np.array_equal(np.load(folder / "train-00000.npy"), want)


@pytest.mark.parametrize("how", ["bytes", "trained"])
def test_the_folder_follows_the_umask(tmp_path, how):
    corpus(tmp_path / "c.jsonl", 100)
    which = ["--tokenizer", "bytes"] if how == "bytes" else ["--train-tokenizer", 300]
    old = os.umask(0o022)
    try:
        assert prepare(*which, "--input", tmp_path / "c.jsonl", "--out", tmp_path / "d") == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "d").iterdir()}
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755
    assert set(modes.values()) == {0o644}, modes


def test_the_reserve_keeps_the_lowest_hashes_that_cover_the_need():
    rng = random.Random(1)
    for _ in range(50):
        keys = [(rng.randrange(1 << 64), rng.randint(1, 40)) for _ in range(rng.randint(0, 300))]
        need = rng.randint(1, 2000)
        reserve = Reserve(need)
        for i in range(0, len(keys), 17):                 # in blocks, as the workers return them
            reserve.add(keys[i:i + 17])
        naive, total = [], 0
        for key in sorted(keys):
            if total >= need:
                break
            naive.append(key)
            total += key[1]
        got = reserve.ascending()
        assert got[:len(naive)] == naive                  # the prefix a raise walks is exact
        assert sum(n for _, n in got) - (got[-1][1] if got else 0) < need or not got
