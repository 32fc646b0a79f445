"""Checkpoint lifecycle: pruning never eats the newest write, crashes mid-commit are recovered,
one-shot flags do not leak into the saved config, and a torn metrics line does not stop a resume."""

import json
import os

import pytest
import torch

from configs import tiny_config
from moepar.checkpoint import (CheckpointError, complete_steps, load_checkpoint,
                               recover_interrupted, save_checkpoint, verify_checkpoint)
from moepar.config import load_config
from moepar.layers import ModelConfig, Transformer
from moepar.parallel import Options, ParallelDims, ParallelOptions, parallelize
from moepar.tensorfile import file_digest
from moepar.train import Trainer


def quiet(_msg):
    pass


def small_model():
    """A one-process handle over a tiny model: (engine, None), the engine saves its optimizer."""
    cfg = ModelConfig(vocab_size=16, dim=8, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=8,
                      moe_ffn_dim=8, num_experts=2, top_k=1, max_seq_len=8)
    layout = ParallelDims(1).bind(0, torch.device("cpu"))
    engine = parallelize(Transformer(cfg, seed=0), layout, Options(
        ParallelOptions(), lambda decay, no_decay: torch.optim.AdamW(decay + no_decay)))
    return engine, None


def test_keep_prunes_only_older_steps(tmp_path):
    model, opt = small_model()
    root = str(tmp_path)
    for step in (100, 200):
        save_checkpoint(root, step, model, {"step": step}, keep=2)
    # Resumed from 100 on another branch: saving 150 must keep 150 (and 200 stays untouched).
    path = save_checkpoint(root, 150, model, {"step": 150}, keep=1)
    assert os.path.isdir(path)
    assert complete_steps(root) == [150, 200]
    save_checkpoint(root, 300, model, {"step": 300}, keep=2)
    assert complete_steps(root) == [200, 300]


def test_recover_interrupted_commit(tmp_path):
    model, opt = small_model()
    root = str(tmp_path)
    save_checkpoint(root, 1, model, {"step": 1})
    save_checkpoint(root, 2, model, {"step": 2})
    os.rename(tmp_path / "step_1", tmp_path / ".step_1.tmp")     # committed, not yet renamed
    os.rename(tmp_path / "step_2", tmp_path / "step_2.old")      # re-save between its renames
    (tmp_path / ".step_3.tmp").mkdir()                            # crashed while writing
    assert complete_steps(root) == []
    done = recover_interrupted(root)
    assert len(done) == 3
    assert complete_steps(root) == [1, 2]
    assert not (tmp_path / ".step_3.tmp").exists()
    verify_checkpoint(str(tmp_path / "step_2"))


def test_unreadable_manifest_is_a_checkpoint_error(tmp_path):
    model, opt = small_model()
    path = save_checkpoint(str(tmp_path), 1, model, {"step": 1})
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        verify_checkpoint(path)


def test_resume_from_refuses_to_shadow_later_checkpoints(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=4", "--run.checkpoint_every=2"), log=quiet)
    trainer.run()
    assert complete_steps(str(tmp_path / "checkpoints")) == [2, 4]
    step2 = str(tmp_path / "checkpoints" / "step_2")
    with pytest.raises(ValueError, match=r"after step 2 .*\[4\]"):
        Trainer(tiny_config(tmp_path, "--train.steps=4", f"--run.resume_from={step2}"), log=quiet)
    resumed = Trainer(tiny_config(tmp_path, "--train.steps=4", f"--run.resume_from={step2}",
                                  "--run.overwrite=true"), log=quiet)
    assert resumed.step == 2 and complete_steps(str(tmp_path / "checkpoints")) == [2]


def test_saved_config_drops_one_shot_flags(tmp_path):
    Trainer(tiny_config(tmp_path, "--train.steps=1"), log=quiet).run()
    Trainer(tiny_config(tmp_path, "--train.steps=2", "--run.resume=true"), log=quiet).run()
    saved = load_config(str(tmp_path / "config.toml"))
    assert (saved.run.resume, saved.run.overwrite, saved.run.resume_from) == (False, False, "")
    # Reusing the saved config as is refuses to clobber instead of deleting checkpoints.
    with pytest.raises(ValueError, match="already holds checkpoints"):
        Trainer(saved, log=quiet)


def test_torn_metrics_line_does_not_block_resume(tmp_path):
    Trainer(tiny_config(tmp_path, "--train.steps=2", "--run.checkpoint_every=1"), log=quiet).run()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.')      # the crash that prompts a resume
    Trainer(tiny_config(tmp_path, "--train.steps=3", "--run.resume=true"), log=quiet).run()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_checkpoint_with_separate_q_k_v_is_refused_by_name(tmp_path):
    # A checkpoint from before q, k and v were fused names them apart; it is refused with a
    # message that says so, and nothing of the model changes.
    model, _ = small_model()
    path = save_checkpoint(str(tmp_path), 1, model, {"step": 1})
    index_file = os.path.join(path, "index.json")
    index = json.loads(open(index_file).read())
    fused = index["model"].pop("layers.0.attn.qkv_proj.weight")
    for proj in ("q_proj", "k_proj", "v_proj"):
        index["model"][f"layers.0.attn.{proj}.weight"] = fused
    with open(index_file, "w") as f:
        json.dump(index, f)
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    manifest["files"]["index.json"] = file_digest(index_file)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attn\.k_proj\.weight'\): it was "
                                              r"written before they became one fused qkv_proj"):
        load_checkpoint(path, model)
    for name, value in model.model.state_dict().items():
        assert torch.equal(value, before[name]), name
