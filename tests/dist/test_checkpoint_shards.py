"""Sharded checkpoints without gathers: each canonical box is written once, by the rank that
owns it; a rank loading at another layout reads only the boxes its shards need, and verifies
only the hashed blocks those reads touch."""

import json
import math
import os

import torch.distributed as dist

from configs import tiny_config
from moepar import checkpoint, tensorfile
from moepar.checkpoint import load as checkpoint_load
from moepar.train import Trainer

F64 = ["--train.dtype=float64", "--model.num_experts=8", "--train.global_batch_size=8",
       "--train.micro_batch_size=2", "--train.steps=1", "--run.checkpoint_every=0"]


def quiet(_msg):
    pass


def case_save(run_dir: str, overrides: list[str], block: int | None = None):
    """Trains a step and saves it (with hashed blocks of `block` bytes when given)."""
    real = tensorfile.BLOCK
    tensorfile.BLOCK = block or real
    try:
        trainer = Trainer(tiny_config(run_dir, *F64, *overrides), log=quiet)
        trainer.run()
    finally:
        tensorfile.BLOCK = real
    dist.barrier()
    return {name: t.shape for name, t in trainer.engine.canonical.items()}


def case_load_counting(run_dir: str, overrides: list[str], path: str, block: int):
    """Resumes from `path` while counting the bytes each rank reads and the blocks it hashes
    (patched in moepar/checkpoint/load.py, the module that calls them)."""
    read, blocks = {"model": 0, "optimizer": 0}, []
    real_read, real_check = checkpoint_load.read_box, checkpoint_load.check_blocks

    def counting_read(file, entry, start, offsets, sizes):
        data = real_read(file, entry, start, offsets, sizes)
        kind = "model" if os.path.basename(file).startswith("model-") else "optimizer"
        read[kind] += data.numel() * data.element_size()
        return data

    def counting_check(file, digest, ranges=None):
        if ranges is not None and os.path.basename(file).endswith(".safetensors"):
            blocks.append((os.path.basename(file), sorted({b for lo, hi in ranges
                                                           for b in range(lo // block, (hi - 1) // block + 1)}),
                           len(digest["blocks"])))
        return real_check(file, digest, ranges)

    checkpoint_load.read_box, checkpoint_load.check_blocks = counting_read, counting_check
    try:
        trainer = Trainer(tiny_config(run_dir, *F64, *overrides, f"--run.resume_from={path}"),
                          log=quiet)
    finally:
        checkpoint_load.read_box, checkpoint_load.check_blocks = real_read, real_check
    local = sum(lt.tensor.numel() * lt.tensor.element_size() for lt in trainer.engine.model_shards())
    dist.barrier()
    return read, local, blocks


def test_each_box_is_written_once_by_its_owner(worlds, tmp_path):
    run_dir = tmp_path / "tp2_ep2"
    shapes = worlds(4).run(case_save, str(run_dir), ["--parallel.tp=2", "--parallel.ep=2"],
                           timeout=120)[0]
    step = run_dir / "checkpoints" / "step_1"
    index = json.loads((step / "index.json").read_text())
    files = {p["file"] for e in index["model"].values() for p in e["pieces"]}
    # dp=2 x tp=2: the dp-0 ranks (0, 1) write dense pieces; experts come from edp rank 0 of
    # each EP group (ranks 0 and 1); ranks 2 and 3 hold replicas and write no model file.
    assert files == {"model-r00000.safetensors", "model-r00001.safetensors"}
    assert not (step / "model-r00002.safetensors").exists()
    # The fused q/k/v: each tp rank writes its q heads, its k heads and its v heads (3 pieces).
    qkv = index["model"]["layers.0.attn.qkv_proj.weight"]["pieces"]
    assert sorted(p["file"] for p in qkv) == ["model-r00000.safetensors"] * 3 + \
        ["model-r00001.safetensors"] * 3
    norm = index["model"]["layers.0.attn_norm.weight"]["pieces"]
    assert [p["file"] for p in norm] == ["model-r00000.safetensors"]
    # The files hold the model exactly once: their tensor bytes are the canonical bytes.
    stored = 0
    for file in files:
        header, _ = tensorfile.read_header(str(step / file))
        stored += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
    assert stored == 8 * sum(math.prod(s) for s in shapes.values())


def test_loading_at_another_layout_reads_only_its_boxes(worlds, tmp_path, monkeypatch):
    run_dir, block = tmp_path / "ep2", 512
    shapes = worlds(2).run(case_save, str(run_dir), ["--parallel.ep=2"], block, timeout=120)[0]
    path = str(run_dir / "checkpoints" / "step_1")
    nbytes = {n: 8 * math.prod(s) for n, s in shapes.items()}
    total, expert = sum(nbytes.values()), sum(v for n, v in nbytes.items() if ".experts." in n)
    buffers = sum(v for n, v in nbytes.items() if n.endswith("expert_bias_E"))
    # dp=4, ep=4, ZeRO-3 (edp=1): every rank holds a quarter of the experts and a quarter of
    # each dense tensor (buffers are whole on every rank), so together the ranks read the
    # model once, plus 3 more copies of the buffers.
    results = worlds(4).run(case_load_counting, str(tmp_path / "zero3"),
                            ["--parallel.ep=4", "--parallel.zero=3"], path, block, timeout=120)
    assert sum(r[0]["model"] for r in results) == total + 3 * buffers
    for read, local, blocks in results:
        assert read["model"] == local          # exactly its shard, nothing more
        assert read["model"] < 0.5 * total
        # of each model file it reads, a rank verifies only some blocks (its experts and its
        # chunks of the dense tensors), never the whole file
        touched = [(f, len(b), n) for f, b, n in blocks if f.startswith("model-")]
        assert touched and all(t < n for _, t, n in touched), touched
    assert expert > 0.5 * total                # experts dominate: a rank reading all would fail


def case_run(run_dir: str, overrides: list[str]):
    records = Trainer(tiny_config(run_dir, *overrides), log=quiet).run()
    dist.barrier()
    return [r["loss"] for r in records]


def test_background_save_under_expert_parallelism(worlds, tmp_path):
    """ep=2 with run.async_checkpoint: the same losses, and checkpoints equal to blocking ones."""
    args = ["--parallel.ep=2", "--parallel.zero=1", "--train.steps=3", "--run.checkpoint_every=1"]
    blocking = worlds(2).run(case_run, str(tmp_path / "sync"), args, timeout=120)
    background = worlds(2).run(case_run, str(tmp_path / "async"),
                               [*args, "--run.async_checkpoint=true"], timeout=120)
    assert background == blocking
    for step in (2, 3):
        want = dict(checkpoint.read_canonical(str(tmp_path / "sync" / "checkpoints" / f"step_{step}")))
        got = dict(checkpoint.read_canonical(str(tmp_path / "async" / "checkpoints" / f"step_{step}")))
        assert want.keys() == got.keys() and all(want[n].equal(got[n]) for n in want)
