"""Document boundaries in prepared folders and the packed sampler (moepar/data/documents.py,
packing.py), checked against the EOS tokens the folder holds and against WindowSampler."""

import json
import os

import numpy as np
import pytest

from configs import packed_folder
from moepar.config import load_config
from moepar.data.folder import PreparedFolder
from moepar.data.packing import PackedSampler
from moepar.data.sources import build_sampler
from moepar.data.tokens import WindowSampler

EOS = 0xFF


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # Shards of 100 tokens: documents straddle the cuts.
    return packed_folder(tmp_path_factory.mktemp("packed"), 60, shard_tokens=100)


def test_prepare_records_each_document_end(folder):
    f = PreparedFolder(folder, "data.path")
    tokens = np.asarray(f.split("train")[0:len(f.split("train"))])
    ends = np.load(os.path.join(folder, "train-documents.npy"))
    assert len(f.shards["train"]) > 3
    assert ends.tolist() == (np.flatnonzero(tokens == EOS) + 1).tolist()
    assert len(ends) == 60


def test_a_folder_without_boundaries_loads_and_refuses_to_pack(folder, tmp_path):
    old = tmp_path / "old"
    os.makedirs(old)
    index = json.load(open(os.path.join(folder, "index.json")))
    for split in index["splits"].values():
        split.pop("documents")
    json.dump(index, open(old / "index.json", "w"))
    for name in os.listdir(folder):
        if not name.endswith("documents.npy") and name.endswith(".npy"):
            os.symlink(os.path.join(folder, name), old / name)
    overrides = ["--data.source=tokens", f"--data.path={old}", "--train.seq_len=16",
                 "--model.max_seq_len=16", f"--run.dir={tmp_path}/run"]
    assert isinstance(build_sampler(load_config(None, overrides)), WindowSampler)
    with pytest.raises(ValueError, match="records no document boundaries"):
        build_sampler(load_config(None, overrides + ["--data.pack=documents"]))


def _sampler(folder, pad):
    f = PreparedFolder(folder, "data.path")
    return PackedSampler(f, f.split("train"), 16, 3, 7, 256, "data.path", pad)


def test_packed_windows_are_the_stream_windows_cut_at_each_eos(folder):
    packed = _sampler(folder, pad=False)
    plain = WindowSampler(packed.tokens, 16, 3, 7, 256)
    for index in range(4):
        inputs, targets, documents = packed.batch(index)
        want_inputs, want_targets = plain.batch(index)
        assert inputs.tolist() == want_inputs.tolist()
        eos = (inputs == EOS).numpy()
        # a new document starts right after each EOS, and an EOS predicts nothing
        assert (np.diff(documents.numpy(), axis=1) == eos[:, :-1]).all()
        assert (targets.numpy() == np.where(eos, -100, want_targets.numpy())).all()
        assert packed.counted(index) == int((targets != -100).sum())


def test_padded_windows_hold_whole_documents(folder):
    sampler = _sampler(folder, pad=True)
    ends = set(sampler.ends.tolist())
    for index in range(4):
        inputs, targets, documents = sampler.batch(index)
        assert sampler.counted(index) == int((targets != -100).sum())
        for row_in, row_doc in zip(inputs.numpy(), documents.numpy(), strict=True):
            real = row_doc >= 0
            assert real[0] and (np.diff(real.astype(int)) <= 0).all()   # padding at the end
            if not real.all():     # the padding follows a whole document: an EOS before it
                assert row_in[real][-1] == EOS
        assert (targets.numpy()[documents.numpy() < 0] == -100).all()


@pytest.mark.parametrize("overrides, message", [
    (["--data.pack=rows"], "data.pack='rows' is not one of"),
    (["--data.pad=true"], "data.pad=true needs data.pack='documents'"),
    (["--data.pack=documents", "--data.source=builtin"], "data.source='tokens' and data.path"),
    (["--data.pack=documents", "--parallel.cp=2"], "parallel.cp=2"),
    (["--data.pack=documents", "--data.pad=true", "--router.type=expert_choice",
      "--router.capacity_factor=1.0"], "router.type='expert_choice'"),
    (["--data.pack=documents", "--model.mtp_layers=1"], "the MTP depths do not mask documents"),
])
def test_config_refuses_what_does_not_pack(folder, tmp_path, overrides, message):
    base = ["--data.source=tokens", f"--data.path={folder}", f"--run.dir={tmp_path}"]
    with pytest.raises(ValueError, match=message):
        load_config(None, base + overrides)
