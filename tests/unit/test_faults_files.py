"""Fault injection on files: hostile or damaged checkpoints, Hugging Face folders and token files
give a named CheckpointError / ConversionError / ValueError, never a traceback, and nothing
changes before everything was checked; conversion never deletes a folder it did not create."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from configs import tiny_config, tiny_mixtral
from moepar.checkpoint import CheckpointError, load_checkpoint
from moepar.tensorfile import file_digest, write_tensors
from moepar.train import Trainer

pytest.importorskip("transformers")

from moepar.hf import ConversionError, from_hf, hf_to_moepar  # noqa: E402


def quiet(_msg):
    pass


# ---- checkpoints --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-step run's directory; each test copies its step_2 checkpoint before damaging it."""
    run_dir = tmp_path_factory.mktemp("saved")
    Trainer(tiny_config(run_dir, "--train.steps=2"), log=quiet).run()
    return run_dir


def copy_checkpoint(saved, tmp_path) -> str:
    import shutil
    dst = tmp_path / "step_2"
    shutil.copytree(saved / "checkpoints" / "step_2", dst)
    return str(dst)


def rehash(path: str, name: str):
    """Updates the manifest's entry for `name`: the damage is deliberate, not accidental, so the
    hashes alone cannot catch it."""
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    manifest["files"][name] = file_digest(os.path.join(path, name))
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def fresh(tmp_path):
    return Trainer(tiny_config(tmp_path / "fresh", "--train.steps=2"), log=quiet)


def snapshot(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def assert_unchanged(trainer, before):
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed although the load was refused"


@pytest.mark.parametrize("damage, message", [
    ("rng_shape", r"rng-r00000.safetensors holds 'torch_cpu' as U8 \[7\], not an RNG state"),
    ("rng_missing", r"rng-r00000.safetensors is not listed in manifest.json"),
    ("negative_position", r"data_position=-8, not a whole number"),
    ("float_step", r"step=2.5, not a whole number"),
    ("absurd_step", r"step=1267650600228229401496703205376, not a whole number"),
    ("integer_tensor", r"layers.0.attn_norm.weight is stored as I32, the model holds torch.float32"),
    ("outside_file", r"manifest.json lists '../model-r00000.safetensors', which is not a file name"),
])
def test_hostile_checkpoint_refused_before_anything_changes(damage, message, saved, tmp_path):
    path = copy_checkpoint(saved, tmp_path)
    rng, state_file = "rng-r00000.safetensors", os.path.join(path, "state.json")
    if damage == "rng_shape":
        write_tensors(os.path.join(path, rng), [("torch_cpu", torch.uint8, (7,),
                                                  lambda: torch.zeros(7, dtype=torch.uint8))])
        rehash(path, rng)
    elif damage == "rng_missing":
        manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
        del manifest["files"][rng]
        json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    elif damage in ("negative_position", "float_step", "absurd_step"):
        state = json.loads(open(state_file).read())
        key, value = {"negative_position": ("data_position", -8), "float_step": ("step", 2.5),
                      "absurd_step": ("step", 2 ** 100)}[damage]
        state[key] = value
        json.dump(state, open(state_file, "w"))
        rehash(path, "state.json")
    elif damage == "integer_tensor":
        # Rewrite the model file with one norm weight stored as int32 (same shape): refused,
        # never cast into the float parameter.
        from moepar.tensorfile import read_box, read_header
        model = os.path.join(path, "model-r00000.safetensors")
        header, start = read_header(model)
        tensors = {k: read_box(model, e, start, [0] * len(e["shape"]), e["shape"])
                   for k, e in header.items()}
        tensors["layers.0.attn_norm.weight"] = tensors["layers.0.attn_norm.weight"].int()
        write_tensors(model, [(k, t.dtype, tuple(t.shape), lambda t=t: t)
                              for k, t in tensors.items()])
        rehash(path, "model-r00000.safetensors")
    else:
        manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
        manifest["files"]["../model-r00000.safetensors"] = manifest["files"]["index.json"]
        json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    trainer = fresh(tmp_path)
    before, rng_before = snapshot(trainer), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, trainer.engine, optimizer=True)
    assert_unchanged(trainer, before)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_index_pieces_that_do_not_tile_are_refused(saved, tmp_path):
    path = copy_checkpoint(saved, tmp_path)
    index = json.loads(open(os.path.join(path, "index.json")).read())
    entry = index["model"]["embed.weight"]
    entry["pieces"][0]["offsets"] = ["0", 0]                 # not a number: a crafted index
    json.dump(index, open(os.path.join(path, "index.json"), "w"))
    rehash(path, "index.json")
    trainer = fresh(tmp_path)
    before = snapshot(trainer)
    with pytest.raises(CheckpointError, match=r"index.json: key 'model.embed.weight.pieces\[0\]"
                                              r".offsets\[0\]' is '0', expected a whole number"):
        load_checkpoint(path, trainer.engine)
    assert_unchanged(trainer, before)


# ---- Hugging Face folders -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny random Mixtral saved by transformers (no download), split in two shards."""
    from safetensors.torch import load_file, save_file
    path = tmp_path_factory.mktemp("hf") / "mixtral"
    tiny_mixtral(path)
    tensors = load_file(path / "model.safetensors")
    os.remove(path / "model.safetensors")
    names = sorted(tensors)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k].contiguous() for k in keys}, path / file)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    return path


def hf_copy(mixtral, tmp_path):
    import shutil
    dst = tmp_path / "src"
    shutil.copytree(mixtral, dst)
    return dst


def set_index(src, change):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    change(index["weight_map"])
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def raw_header(file):
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def write_raw(file, header, data):
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("damage, message", [
    ("giant_header", r"a.safetensors: header length 18446744073709551615 exceeds the file"),
    ("past_end", r"past the end of the data .*truncated or damaged"),
    ("overlap", r"a.safetensors: tensors .* overlap"),
    ("wrong_file", r"a.safetensors holds \['lm_head.weight'\], which the index puts elsewhere"),
    ("parent_dir", r"names the file '../a.safetensors', which is not a file inside the folder"),
    ("absolute", r"names the file '/.*a.safetensors', which is not a file inside the folder"),
    ("integer", r"'layers.\d.attn_norm.weight' is stored as torch.int64; the model holds "
                r"floating point"),
])
def test_hostile_hf_folder_is_a_conversion_error(damage, message, mixtral, tmp_path):
    src = hf_copy(mixtral, tmp_path)
    a = src / "a.safetensors"
    header, data = raw_header(a)
    first = next(k for k in sorted(header) if k != "__metadata__")
    if damage == "giant_header":
        a.write_bytes(struct.pack("<Q", 2 ** 64 - 1) + a.read_bytes()[8:])
    elif damage == "past_end":
        write_raw(a, header, data[:len(data) // 2])
    elif damage == "overlap":
        second = next(k for k in sorted(header) if k not in ("__metadata__", first))
        header[second]["data_offsets"] = list(header[first]["data_offsets"])
        header[second]["shape"] = list(header[first]["shape"])
        header[second]["dtype"] = header[first]["dtype"]
        write_raw(a, header, data)
    elif damage == "wrong_file":
        set_index(src, lambda m: m.update({"lm_head.weight": "b.safetensors"}))
    elif damage in ("parent_dir", "absolute"):
        (tmp_path / "a.safetensors").write_bytes(a.read_bytes())    # a file outside src
        target = "../a.safetensors" if damage == "parent_dir" else str(tmp_path / "a.safetensors")
        set_index(src, lambda m: m.update({k: target for k, f in m.items() if f == "a.safetensors"}))
    else:
        from safetensors.torch import load_file, save_file
        tensors = load_file(a)
        name = next(k for k in tensors if k.endswith("input_layernorm.weight"))
        tensors[name] = torch.ones_like(tensors[name], dtype=torch.int64)
        save_file(tensors, a)
    with pytest.raises(ConversionError, match=message):
        from_hf(str(src))
    with pytest.raises(ConversionError, match=message):
        hf_to_moepar(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_config_json_too_big_for_its_files_is_refused_before_building(mixtral, tmp_path):
    """200k layers x 5k experts: building even the meta model would hang; the parameter count
    is compared with the files (and memory) first."""
    src = hf_copy(mixtral, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config.update(num_hidden_layers=200_000, num_local_experts=5_000)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"model.num_layers=200000 exceeds 1,024"):
        hf_to_moepar(str(src), str(tmp_path / "out"), log=quiet)
    config.update(num_hidden_layers=1_000)      # within the bounds, still no fit for the files
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"config.json describes a model of .* parameters "
                                              r"but its safetensors files hold"):
        from_hf(str(src))


def test_model_bigger_than_memory_is_refused(mixtral, tmp_path, monkeypatch):
    import moepar.hf.convert as convert
    monkeypatch.setattr(convert, "_available_memory", lambda: 1000)
    with pytest.raises(ConversionError, match=r"needs 0.0 GiB of memory, this machine has"):
        from_hf(str(mixtral))


@pytest.mark.parametrize("text, message", [
    ("[1, 2, 3]", "holds a JSON list, not an object of settings"),
    ('{"model_type": "mixtral", "hidden_size": "32"}', r"hidden_size='32' is not a whole number"),
    ('{"model_type": "mixtral", "hidden_size": 32}', "lacks 'num_attention_heads'"),
    ("{not json", "is not valid JSON"),
])
def test_malformed_config_json_is_named(text, message, mixtral, tmp_path):
    src = hf_copy(mixtral, tmp_path)
    if text.startswith('{"model_type": "mixtral", "hidden_size": "'):
        config = json.loads((src / "config.json").read_text())
        config["hidden_size"] = "32"
        text = json.dumps(config)
    (src / "config.json").write_text(text)
    with pytest.raises(ConversionError, match=message):
        hf_to_moepar(str(src), str(tmp_path / "out"))


def test_convert_never_touches_a_folder_beside_its_output(mixtral, tmp_path):
    """`X.tmp` is the user's: conversion writes to a fresh hidden name and renames; the config it
    writes has its own run.dir (runs/<name of X>), not the default runs/tiny."""
    import tomllib
    keep = tmp_path / "out.tmp"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    hf_to_moepar(str(mixtral), str(tmp_path / "out"))
    assert (keep / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["out", "out.tmp"]
    with open(tmp_path / "out" / "config.toml", "rb") as f:
        assert tomllib.load(f)["run"] == {"dir": "runs/out"}


# ---- token files --------------------------------------------------------------------------------

TRUNCATE = """
import os, sys
import numpy as np
from moepar.data.tokens import WindowSampler, read_token_file
path = sys.argv[1]
tokens = read_token_file(path, "uint16", "data.path")
sampler = WindowSampler(tokens, 64, 4, 0, 1000)
sampler.batch(0)
with open(path, "r+b") as f:
    f.truncate(100)
try:
    for i in range(1, 200):
        sampler.batch(i)
except ValueError as e:
    print(e)
    sys.exit(7)
"""


def test_token_file_truncated_while_training_is_named_not_sigbus(tmp_path):
    """A memory-mapped token file that shrinks under the run kills it with SIGBUS; reads must
    notice instead (run in a child process, so SIGBUS cannot take pytest down)."""
    path = tmp_path / "tokens.bin"
    (np.arange(1 << 20, dtype=np.uint16) % 1000).tofile(path)
    result = subprocess.run([sys.executable, "-c", TRUNCATE, str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 7, (result.returncode, result.stderr[-2000:])
    assert f"{path} has 100 bytes now" in result.stdout and "truncated" in result.stdout
