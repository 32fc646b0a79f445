"""Reading prepared folders: shards as one sequence, damage caught before mapping, blends in the
configured proportions, the dataset fingerprint, fixed validation batches, exact resume."""

import json
import os
import random

import numpy as np
import pytest
import torch

from configs import tiny_config
from moepar.config import DataConfig, load_config
from moepar.data import (BlendedSampler, PreparedFolder, WindowSampler, build_sampler,
                         check_same_dataset, fingerprint, load_tokens, validation_batches)
from moepar.data.prepare import PrepareOptions, prepare
from moepar.train import Trainer


def quiet(_msg):
    pass


def make_folder(tmp_path, name, docs, **kw) -> str:
    """A prepared folder of `docs` with the byte tokenizer; returns its path."""
    src = tmp_path / f"{name}.txt"
    src.write_text("\n\n".join(docs))
    kw.setdefault("val_fraction", 0.2)
    out = str(tmp_path / name)
    prepare(PrepareOptions(tokenizer="bytes", inputs=[str(src)], out=out, split_blank_lines=True,
                           **kw), stderr=open(os.devnull, "w"))
    return out


def sentences(n, letters="abcdefgh ", seed=0):
    rng = random.Random(seed)
    return ["".join(rng.choice(letters) for _ in range(rng.randint(20, 120))) for _ in range(n)]


def all_tokens(folder, split):
    index = json.load(open(os.path.join(folder, "index.json")))
    return np.concatenate([np.load(os.path.join(folder, s["file"]))
                           for s in index["splits"][split]["shards"]])


def data_cfg(*overrides) -> DataConfig:
    return load_config(None, ["--data.source=tokens", *overrides]).data


def test_shards_read_as_one_sequence(tmp_path):
    folder = make_folder(tmp_path, "f", sentences(60), shard_tokens=97)
    whole = all_tokens(folder, "train")
    tokens = PreparedFolder(folder, "data.path").split("train")
    assert len(tokens) == len(whole) and len(os.listdir(folder)) > 6
    tokens.max_open = 2      # evicting maps must not change what is read
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = int(rng.integers(0, len(whole)))
        b = int(rng.integers(a, min(len(whole), a + 400) + 1))
        assert np.array_equal(tokens[a:b], whole[a:b]), (a, b)
    # The sampler over shards draws exactly the windows it draws over the concatenated array.
    sharded = WindowSampler(tokens, 16, 4, 3, 256)
    plain = WindowSampler(whole, 16, 4, 3, 256)
    for i in range(20):
        for got, want in zip(sharded.batch(i), plain.batch(i), strict=True):
            assert torch.equal(got, want)


def test_damaged_shards_are_errors_not_sigbus(tmp_path):
    folder = make_folder(tmp_path, "f", sentences(40), shard_tokens=200, val_fraction=0)
    shard = os.path.join(folder, "train-00001.npy")
    good = open(shard, "rb").read()

    def reading(match):
        with pytest.raises(ValueError, match=match):
            PreparedFolder(folder, "data.path").split("train")

    open(shard, "wb").write(good[:-10])
    reading(r"train-00001\.npy has \d+ bytes, its header promises \d+ .*truncated or damaged")
    open(shard, "wb").write(b"garbage" + good[7:])
    reading(r"train-00001\.npy is not a readable \.npy file")
    np.save(shard, np.zeros(200, dtype=np.uint32))
    reading(r"train-00001\.npy holds uint32, the index says uint16")
    np.save(shard, np.zeros(150, dtype=np.uint16))
    reading(r"train-00001\.npy holds 150 tokens, the index says 200")
    os.remove(shard)
    reading(r"train-00001\.npy is missing")
    # A lone .npy given as data.path is checked the same way.
    np.save(tmp_path / "t.npy", np.arange(1000, dtype=np.uint16))
    open(tmp_path / "t.npy", "r+b").truncate(1000)
    with pytest.raises(ValueError, match=r"t\.npy has 1000 bytes.*truncated"):
        load_tokens(data_cfg(f"--data.path={tmp_path / 't.npy'}"))


def test_bad_index(tmp_path):
    folder = make_folder(tmp_path, "f", sentences(10))
    index_path = os.path.join(folder, "index.json")
    index = json.load(open(index_path))
    for text, match in [("{not json", r"index\.json is not valid JSON"),
                        (json.dumps({**index, "format": "other"}), r"not a moepar token index"),
                        (json.dumps({**index, "version": 9}), r"has version 9"),
                        (json.dumps({**index, "tokenizer": {}}), r"key 'tokenizer' lacks 'sha256'")]:
        open(index_path, "w").write(text)
        with pytest.raises(ValueError, match=match):
            PreparedFolder(folder, "data.path")


@pytest.mark.parametrize("overrides, match", [
    (["--data.path=A", "--data.paths=A,B"], r"data\.path and data\.paths are both set"),
    ([], r"data\.source='tokens' needs data\.path"),
    (["--data.paths=A", "--data.weights=1"], r"data\.paths\[0\]='A' is not a file or a prepared"),
    (["--data.paths=F,G", "--data.weights=1"], r"data\.weights has 1 entries, data\.paths has 2"),
    (["--data.paths=F,G", "--data.weights=1,0"], r"data\.weights\[1\]=0\.0 must be a finite number > 0"),
    (["--data.paths=F,G", "--data.weights=1,nan"], r"data\.weights\[1\]=nan"),
    (["--data.paths=F,F/"], r"data\.paths\[1\]=.* repeats data\.paths\[0\]"),
    (["--data.path=F", "--data.weights=1"], r"data\.weights needs data\.paths"),
    (["--data.path=E"], r"data\.path=.*E' is a directory without index\.json.*moepar data prepare"),
])
def test_data_config_errors_name_the_key(tmp_path, overrides, match):
    make_folder(tmp_path, "F", sentences(10))
    make_folder(tmp_path, "G", sentences(10, seed=1))
    (tmp_path / "E").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ValueError, match=match):
            data_cfg(*overrides)
    finally:
        os.chdir(cwd)


def test_builtin_refuses_paths():
    with pytest.raises(ValueError, match=r"data\.paths is set but data\.source='builtin'"):
        DataConfig(paths=["x"])


def test_vocabulary_and_tokenizer_mismatches_refused(tmp_path):
    folder = make_folder(tmp_path, "bytes", sentences(30))
    with pytest.raises(ValueError, match=r"data\.path=.*bytes' was tokenized with a vocabulary of "
                                         r"256 ids, more than model\.vocab_size=200"):
        build_sampler(tiny_config(tmp_path / "r", "--data.source=tokens",
                                  f"--data.path={folder}", "--model.vocab_size=200"))
    other = make_folder(tmp_path, "other", sentences(30, seed=2))
    index = json.load(open(os.path.join(other, "index.json")))
    index["tokenizer"]["sha256"] = "0" * 64
    json.dump(index, open(os.path.join(other, "index.json"), "w"))
    with pytest.raises(ValueError, match=r"data\.paths\[1\]=.* was prepared with another tokenizer"):
        build_sampler(tiny_config(tmp_path / "r", "--data.source=tokens",
                                  f"--data.paths={folder},{other}"))


def source_counts(sampler, num_batches):
    """Rows per source, told apart by content: source 0 holds only a-h, source 1 only digits."""
    counts = [0, 0]
    for i in range(num_batches):
        inputs, _ = sampler.batch(i)
        for row in inputs.tolist():
            text = bytes(t for t in row if t != 255)
            counts[text[:1].isdigit()] += 1
            assert text.isdigit() or not any(c in text for c in b"0123456789")
    return counts


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1.0, 9.0], []])
def test_blend_follows_the_weights(tmp_path, weights):
    letters = make_folder(tmp_path, "letters", sentences(200, "abcdefgh"))
    digits = make_folder(tmp_path, "digits", sentences(50, "0123456789", seed=1))
    extra = [f"--data.weights={','.join(map(str, weights))}"] if weights else []
    cfg = tiny_config(tmp_path / "r", "--data.source=tokens", f"--data.paths={letters},{digits}",
                      "--train.seq_len=8", *extra)
    sampler = build_sampler(cfg)
    assert isinstance(sampler, BlendedSampler)
    sizes = [len(PreparedFolder(p, "x").split("train")) for p in (letters, digits)]
    share = (weights[1] / sum(weights)) if weights else sizes[1] / sum(sizes)
    n = 400 * cfg.train.micro_batch_size
    counts = source_counts(sampler, 400)
    sd = (n * share * (1 - share)) ** 0.5
    assert abs(counts[1] - n * share) < 4 * sd, (counts, n * share, sd)
    assert sampler.fingerprint["weights"] == pytest.approx([1 - share, share], rel=1e-12)
    # A pure function of (seed, index): a new sampler rebuilds any batch.
    again = build_sampler(cfg)
    for i in (0, 17, 399):
        for got, want in zip(sampler.batch(i), again.batch(i), strict=True):
            assert torch.equal(got, want)


def test_fingerprint_tells_datasets_apart(tmp_path):
    a = make_folder(tmp_path, "a", sentences(40))
    b = make_folder(tmp_path, "b", sentences(40, seed=5))
    fa = fingerprint(data_cfg(f"--data.path={a}"))
    assert fa == fingerprint(data_cfg(f"--data.path={a}"))
    check_same_dataset(fa, fingerprint(data_cfg(f"--data.path={a}")))
    check_same_dataset(None, fa)     # checkpoints from before fingerprints
    with pytest.raises(ValueError, match=r"another dataset.*source 0 shards_sha256: checkpoint"):
        check_same_dataset(fa, fingerprint(data_cfg(f"--data.path={b}")))
    blend = fingerprint(data_cfg(f"--data.paths={a},{b}", "--data.weights=1,1"))
    with pytest.raises(ValueError, match=r"blend weights: checkpoint \[0\.5, 0\.5\], now \[0\.75"):
        check_same_dataset(blend, fingerprint(data_cfg(f"--data.paths={a},{b}",
                                                       "--data.weights=3,1")))
    with pytest.raises(ValueError, match=r"1 source\(s\) in the checkpoint, 2 now"):
        check_same_dataset(fa, blend)
    # Paths are not part of it: a moved folder is the same dataset.
    os.rename(a, tmp_path / "moved")
    assert fingerprint(data_cfg(f"--data.path={tmp_path / 'moved'}")) == fa


def test_validation_batches_are_fixed_held_out_windows(tmp_path):
    folder = make_folder(tmp_path, "f", sentences(300), val_fraction=0.3, shard_tokens=500)
    val = all_tokens(folder, "val")
    cfg = data_cfg(f"--data.path={folder}")
    batches = validation_batches(cfg, 3, 4, 16, vocab_size=256)
    assert len(batches) == 3 and batches[0][0].shape == (4, 16)
    again = validation_batches(cfg, 3, 4, 16)
    starts = []
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
            window = np.array(row_x + row_y[-1:])
            # each window is a slice of the val split (found by brute force)
            hits = [s for s in range(len(val) - 16) if np.array_equal(val[s:s + 17], window)]
            assert hits, "window not in the validation split"
            starts.append(hits[0])
    assert starts == sorted(starts) and min(np.diff(starts)) >= 16   # no token predicted twice
    with pytest.raises(ValueError, match=r"validation split has \d+ tokens, fewer than 4000 "
                                         r"windows"):
        validation_batches(cfg, 1000, 4, 16)
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"only folders from `moepar data prepare` have a "
                                         r"validation split"):
        validation_batches(data_cfg(f"--data.path={tmp_path / 't.npy'}"), 1, 1, 8)


def test_validation_batches_share_windows_by_weight(tmp_path):
    letters = make_folder(tmp_path, "letters", sentences(200, "abcdefgh"), val_fraction=0.4)
    digits = make_folder(tmp_path, "digits", sentences(200, "0123456789"), val_fraction=0.4)
    cfg = data_cfg(f"--data.paths={letters},{digits}", "--data.weights=3,1")
    rows = [r for x, _ in validation_batches(cfg, 5, 4, 8) for r in x.tolist()]
    from_digits = [bytes(t for t in r if t != 255)[:1].isdigit() for r in rows]
    assert from_digits == [False] * 15 + [True] * 5      # 20 windows, 3:1, source by source


def resume_config(run_dir, folder, *extra):
    return tiny_config(run_dir, "--data.source=tokens", f"--data.path={folder}",
                       "--train.steps=6", *extra)


def test_resume_from_a_prepared_folder_is_exact(tmp_path):
    folder = make_folder(tmp_path, "f", sentences(200), shard_tokens=1000)
    full = Trainer(resume_config(tmp_path / "full", folder), log=quiet).run()
    first = Trainer(resume_config(tmp_path / "part", folder, "--run.checkpoint_every=3"), log=quiet)
    for _ in range(3):
        first.train_step()
    first.save()
    resumed = Trainer(resume_config(tmp_path / "part", folder, "--run.resume=true"), log=quiet)
    assert resumed.step == 3
    tail = resumed.run()
    assert [r["loss"] for r in tail] == [r["loss"] for r in full[3:]]
    # Another dataset under the same run is refused, naming what differs.
    other = make_folder(tmp_path, "g", sentences(200, seed=9))
    with pytest.raises(ValueError, match=r"another dataset than the checkpoint's: source 0 "
                                         r"shards_sha256"):
        Trainer(resume_config(tmp_path / "part", other, "--run.resume=true",
                              "--train.steps=8"), log=quiet)
