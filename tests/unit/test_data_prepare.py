"""`moepar data prepare`: shards equal an independent tokenization, the split follows its rule,
the index is right, the worker count changes nothing, and every bad input fails cleanly."""

import gzip
import hashlib
import json
import os
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from moepar.data.prepare import PrepareError, PrepareOptions, prepare

WORDS = "the cat sat on a mat and dog ran far away from home with one red ball".split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def word_tokenizer(folder, specials=("[UNK]", "</s>")) -> str:
    """A WordLevel tokenizer.json trained on the fly; returns its path."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(documents(200), trainers.WordLevelTrainer(special_tokens=list(specials)))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


def write_jsonl(path, docs, field="text", gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return str(path)


def run(tmp_path, tokenizer, inputs, **kw) -> dict:
    kw.setdefault("out", str(tmp_path / "out"))
    return prepare(PrepareOptions(tokenizer=tokenizer, inputs=[str(p) for p in inputs], **kw),
                   stderr=open(os.devnull, "w"))


def read_split(out, index, split) -> np.ndarray:
    parts = [np.load(os.path.join(out, s["file"])) for s in index["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=index["dtype"])


def is_val(text: str, seed: int, fraction: float) -> bool:
    """The documented rule, restated: blake2b-64 of the text keyed by the seed, below fraction."""
    digest = hashlib.blake2b(text.encode(), key=seed.to_bytes(16, "little", signed=True),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2 ** 64


def expected(tokenizer_path, docs, eos, seed, fraction):
    tok = Tokenizer.from_file(tokenizer_path)
    out = {"train": [], "val": []}
    for d in docs:
        out["val" if is_val(d, seed, fraction) else "train"] += tok.encode(d, add_special_tokens=False).ids + [eos]
    return out


@pytest.mark.parametrize("workers", [1, 3])
def test_shards_equal_independent_tokenization(tmp_path, workers):
    tok_path = word_tokenizer(tmp_path / "tok")
    docs = documents(600, seed=1)
    a = write_jsonl(tmp_path / "a.jsonl", docs[:400])
    b = write_jsonl(tmp_path / "b.jsonl.gz", docs[400:], gz=True)
    index = run(tmp_path, tok_path, [a, b], val_fraction=0.2, seed=7, workers=workers,
                block_bytes=512, shard_tokens=1000)
    out = str(tmp_path / "out")
    eos = Tokenizer.from_file(tok_path).token_to_id("</s>")
    want = expected(tok_path, docs, eos, 7, 0.2)
    for split in ("train", "val"):
        got = read_split(out, index, split)
        assert got.dtype == np.uint16
        assert got.tolist() == want[split], split
        shards = index["splits"][split]["shards"]
        assert [s["num_tokens"] for s in shards[:-1]] == [1000] * (len(shards) - 1)
        assert index["splits"][split]["num_tokens"] == len(want[split])
        for s in shards:
            data = open(os.path.join(out, s["file"]), "rb").read()
            assert s["sha256"] == hashlib.sha256(data).hexdigest()
    n_val = sum(is_val(d, 7, 0.2) for d in docs)
    assert index["splits"]["val"]["num_documents"] == n_val
    assert index["splits"]["train"]["num_documents"] == 600 - n_val
    # 600 documents at 0.2: the binomial sd is ~9.8; the rule must actually hold some out.
    assert abs(n_val - 120) < 4 * (600 * 0.2 * 0.8) ** 0.5
    tok = index["tokenizer"]
    assert tok["sha256"] == hashlib.sha256(open(tok_path, "rb").read()).hexdigest()
    assert tok["vocab_size"] == Tokenizer.from_file(tok_path).get_vocab_size()
    assert (tok["eos_id"], tok["eos_token"]) == (eos, "</s>")
    assert open(os.path.join(out, "tokenizer.json"), "rb").read() == open(tok_path, "rb").read()
    assert [i["train_documents"] + i["val_documents"] for i in index["inputs"]] == [400, 200]
    assert json.load(open(os.path.join(out, "index.json"))) == index


def test_worker_count_and_block_size_change_nothing(tmp_path):
    tok_path = word_tokenizer(tmp_path / "tok")
    text = "\n\n".join(documents(300, seed=2)) + "\n"
    (tmp_path / "a.txt").write_text(text)
    outs = []
    for k, (workers, block) in enumerate([(1, 1 << 20), (2, 300), (3, 77)]):
        run(tmp_path, tok_path, [tmp_path / "a.txt"], out=str(tmp_path / f"o{k}"), workers=workers,
            block_bytes=block, split_blank_lines=True, shard_tokens=500)
        outs.append({f: open(tmp_path / f"o{k}" / f, "rb").read()
                     for f in sorted(os.listdir(tmp_path / f"o{k}"))})
    assert outs[0] == outs[1] == outs[2]


def test_txt_documents_whole_file_and_paragraphs(tmp_path):
    (tmp_path / "one.txt").write_text("a b\n\n\nc d\n")
    (tmp_path / "two.txt").write_text("\n \nhello  world\r\n  \r\nagain\n\n")
    index = run(tmp_path, "bytes", [tmp_path / "one.txt", tmp_path / "two.txt"], val_fraction=0,
                out=str(tmp_path / "whole"))
    got = read_split(str(tmp_path / "whole"), index, "train")
    assert bytes(got.tolist()) == b"a b\n\n\nc d\n\xff\n \nhello  world\r\n  \r\nagain\n\n\xff"
    index = run(tmp_path, "bytes", [tmp_path / "one.txt", tmp_path / "two.txt"], val_fraction=0,
                split_blank_lines=True, out=str(tmp_path / "paras"))
    got = read_split(str(tmp_path / "paras"), index, "train")
    assert bytes(got.tolist()) == b"a b\xffc d\xffhello  world\xffagain\xff"
    assert index["splits"]["train"]["num_documents"] == 4
    assert (index["tokenizer"]["vocab_size"], index["tokenizer"]["eos_id"]) == (256, 255)


def test_vocabulary_above_65536_uses_uint32(tmp_path):
    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = ["w69999 w2 w65536", "w70000 w3"]
    index = run(tmp_path, str(tmp_path), [write_jsonl(tmp_path / "a.jsonl", docs)], val_fraction=0)
    got = read_split(str(tmp_path / "out"), index, "train")
    assert index["dtype"] == "uint32" and got.dtype == np.uint32
    assert got.tolist() == [69999, 2, 65536, 1, 0, 3, 1]     # w70000 is unknown: [UNK] = 0


def test_eos_sources(tmp_path):
    """tokenizer_config.json, then the post-processor, then known special tokens; --eos-token wins."""
    folder = tmp_path / "model"
    path = word_tokenizer(folder, specials=("[UNK]", "<|endoftext|>", "<end>"))
    doc = write_jsonl(tmp_path / "a.jsonl", ["the cat"])
    tok = Tokenizer.from_file(path)
    assert run(tmp_path, str(folder), [doc], out=str(tmp_path / "o1"))["tokenizer"]["eos_id"] == \
        tok.token_to_id("<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    assert run(tmp_path, str(folder), [doc], out=str(tmp_path / "o2"))["tokenizer"]["eos_id"] == \
        tok.token_to_id("<end>")
    index = run(tmp_path, path, [doc], out=str(tmp_path / "o3"), eos_token="[UNK]")
    assert index["tokenizer"]["eos_id"] == tok.token_to_id("[UNK]")
    # A post-processor that appends a token to every sequence names the EOS; encoding adds none.
    plain = tmp_path / "plain"
    word_tokenizer(plain, specials=("[UNK]", "<sep>"))
    tok = Tokenizer.from_file(str(plain / "tokenizer.json"))
    sep = tok.token_to_id("<sep>")
    tok.post_processor = processors.TemplateProcessing(single="$A <sep>", special_tokens=[("<sep>", sep)])
    tok.save(str(plain / "tokenizer.json"))
    index = run(tmp_path, str(plain), [doc], out=str(tmp_path / "o4"), val_fraction=0)
    assert index["tokenizer"]["eos_id"] == sep
    assert read_split(str(tmp_path / "o4"), index, "train").tolist() == \
        tok.encode("the cat", add_special_tokens=False).ids + [sep]


def test_truncation_in_tokenizer_json_is_ignored(tmp_path):
    path = word_tokenizer(tmp_path / "tok")
    tok = Tokenizer.from_file(path)
    tok.enable_truncation(max_length=2)
    tok.save(path)
    index = run(tmp_path, path, [write_jsonl(tmp_path / "a.jsonl", ["the cat sat on a mat"])],
                val_fraction=0)
    assert index["splits"]["train"]["num_tokens"] == 7      # six words and EOS, not two


def test_split_depends_on_seed_only(tmp_path):
    docs = documents(400, seed=3)
    a = write_jsonl(tmp_path / "a.jsonl", docs)
    b = write_jsonl(tmp_path / "b.jsonl", docs[::-1])
    val = {}
    for name, path, seed in [("a0", a, 0), ("b0", b, 0), ("a1", a, 1)]:
        index = run(tmp_path, "bytes", [path], out=str(tmp_path / name), seed=seed, val_fraction=0.25)
        got = bytes(read_split(str(tmp_path / name), index, "val").tolist())
        val[name] = sorted(got.split(b"\xff")[:-1])
    assert val["a0"] == val["b0"]          # the same documents, whatever their order
    assert val["a0"] != val["a1"]


# ---- bad input: a clear error naming the file (and line), nothing left behind -------------------

def bad(tmp_path, inputs, match, tokenizer="bytes", workers=1, **kw):
    out = tmp_path / "sub" / "out"
    with pytest.raises(ValueError, match=match):
        run(tmp_path, tokenizer, inputs, out=str(out), workers=workers, **kw)
    leftovers = os.listdir(out.parent) if out.parent.exists() else []
    assert leftovers == [], leftovers


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("content, match", [
    ('{"text": "a"}\n{"txt": "b", "id": 3}\n', r"a\.jsonl:2: no 'text' field \(keys: 'txt', 'id'\)"),
    ('{"text": "a"}\n\n{"text": "b"\n', r"a\.jsonl:3: invalid JSON"),
    ('{"text": 5}\n', r"a\.jsonl:1: field 'text' is a int, not a string"),
    ('["text"]\n', r"a\.jsonl:1: a JSON list, not an object"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"a\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 14"),
    ('\n  \n', r"a\.jsonl: empty input: no documents"),
    ('{"text": ""}\n', r"a\.jsonl: empty input: no documents \(only empty texts\)"),
])
def test_bad_jsonl(tmp_path, content, match, workers):
    path = tmp_path / "a.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    bad(tmp_path, [path], match, workers=workers)


def test_bad_txt_and_files(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("fine text")
    (tmp_path / "latin.txt").write_bytes(b"line one\nline two \xff\n")
    bad(tmp_path, [good, tmp_path / "latin.txt"], r"latin\.txt:2: not UTF-8")
    (tmp_path / "blank.txt").write_text("\n \n\n")
    bad(tmp_path, [tmp_path / "blank.txt"], r"blank\.txt: empty input", split_blank_lines=True)
    (tmp_path / "zero.txt").write_text("")
    bad(tmp_path, [good, tmp_path / "zero.txt"], r"zero\.txt: empty input \(0 bytes\)")
    bad(tmp_path, [tmp_path / "missing.jsonl"], r"missing\.jsonl: no such file")
    (tmp_path / "data.csv").write_text("a,b")
    bad(tmp_path, [tmp_path / "data.csv"], r"data\.csv: unknown input type.*\.jsonl\.gz")
    bad(tmp_path, [good, good], r"good\.txt: given twice")
    gz = gzip.compress(b'{"text": "a"}\n' * 5000)
    (tmp_path / "cut.jsonl.gz").write_bytes(gz[:len(gz) // 2])
    bad(tmp_path, [tmp_path / "cut.jsonl.gz"], r"cut\.jsonl\.gz: cannot read past line")
    bad(tmp_path, [good], r"--tokenizer: .*nope.* does not exist", tokenizer=str(tmp_path / "nope"))
    bad(tmp_path, [good], r"--tokenizer: .*a folder without tokenizer\.json", tokenizer=str(tmp_path))
    bad(tmp_path, [good], r"--val-fraction 1\.0 must be in \[0, 1\)", val_fraction=1.0)


def test_tokenizer_without_eos_is_refused(tmp_path):
    path = word_tokenizer(tmp_path / "tok", specials=("[UNK]",))
    good = tmp_path / "good.txt"
    good.write_text("the cat")
    bad(tmp_path, [good], r"tokenizer\.json: no EOS token found.*pass --eos-token", tokenizer=path)
    bad(tmp_path, [good], r"--eos-token '<eos>' is not a token of", tokenizer=path, eos_token="<eos>")


def test_out_is_never_clobbered_by_accident(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("some text")
    out = tmp_path / "out"
    run(tmp_path, "bytes", [good], out=str(out))
    with pytest.raises(PrepareError, match=r"--out .*out already exists; pass --overwrite"):
        run(tmp_path, "bytes", [good], out=str(out))
    good.write_text("other text")
    run(tmp_path, "bytes", [good], out=str(out), overwrite=True, val_fraction=0)
    assert bytes(np.load(out / "train-00000.npy").tolist()) == b"other text\xff"
    assert sorted(os.listdir(tmp_path)) == ["good.txt", "out"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(PrepareError, match=r"is not a prepared folder.*delete it yourself"):
        run(tmp_path, "bytes", [good], out=str(precious), overwrite=True)
    assert (precious / "thesis.tex").read_text() == "years of work"
