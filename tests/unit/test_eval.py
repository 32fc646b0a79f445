"""Validation during training and `moepar eval` (one process): the logged val_loss equals a plain
forward of the saved weights over the validation batches, the batches are split over dp ranks as
a training step's micro-batches, TensorBoard gets val/ scalars, bad settings are named."""

import json
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

from configs import tiny_config
from moepar.checkpoint import load_checkpoint
from moepar.data import validation_batches
from moepar.data.prepare import PrepareOptions, prepare
from moepar.validation import Validation, perplexity
from moepar.layers import Transformer
from moepar.parallel import ParallelDims
from moepar.train import Trainer


def byte_folder(tmp_path, name="data") -> str:
    """A prepared byte-level folder with a validation split of ~30% of the documents."""
    rng = random.Random(0)
    words = "the cat sat on a mat and dog ran far away from home with one red ball".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(300)]
    src = tmp_path / f"{name}.txt"
    src.write_text("\n\n".join(docs))
    out = str(tmp_path / name)
    prepare(PrepareOptions(tokenizer="bytes", inputs=[str(src)], out=out, split_blank_lines=True,
                           val_fraction=0.3), stderr=open(os.devnull, "w"))
    return out


EVAL = ["--train.dtype=float64", "--router.capacity_factor=1.0", "--train.eval_every=2",
        "--train.eval_batches=2", "--train.steps=3", "--run.checkpoint_every=2",
        "--data.source=tokens"]


def reference_loss(cfg, checkpoint) -> float:
    """Mean cross-entropy of the checkpoint's weights over the validation micro-batches, each
    one forward of a whole model (one capacity group), without the trainer's handle."""
    model = Transformer(cfg.model, cfg.router).double()
    load_checkpoint(checkpoint, model, restore_rng=False)
    t = cfg.train
    batches = validation_batches(cfg.data, t.eval_batches * t.global_batch_size // t.micro_batch_size,
                                 t.micro_batch_size, t.seq_len)
    with torch.no_grad():
        losses = [F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()) for x, y in batches]
    return float(sum(losses)) / len(losses)


def test_training_logs_the_validation_loss_of_its_weights(tmp_path):
    data = byte_folder(tmp_path)
    cfg = tiny_config(tmp_path / "run", *EVAL, f"--data.path={data}")
    records = Trainer(cfg, log=lambda _m: None).run()
    assert [("val_loss" in r, "val_ppl" in r) for r in records] == [(False, False), (True, True),
                                                                   (True, True)]  # step 2, last
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [line.get("val_loss") for line in lines] == [r.get("val_loss") for r in records]
    for step in (2, 3):
        record = records[step - 1]
        want = reference_loss(cfg, tmp_path / "run" / "checkpoints" / f"step_{step}")
        assert math.isclose(record["val_loss"], want, rel_tol=1e-12), (step, record, want)
        assert record["val_ppl"] == pytest.approx(math.exp(want), rel=1e-12)
    assert records[1]["val_loss"] != records[2]["val_loss"]     # the weights moved
    assert records[0]["loss"] > records[2]["val_loss"] > 1.0    # learned, and not memorised


def test_validation_share_follows_the_training_split(monkeypatch):
    """Global micro-batch i of each evaluation round goes to dp rank i // local micro-batches;
    tp and pp ranks of one dp rank evaluate the same ones."""
    import moepar.data.sources
    cfg = tiny_config("unused", "--train.global_batch_size=8", "--train.micro_batch_size=2",
                      "--train.eval_batches=3")
    windows = [(torch.full((2, 4), i), torch.full((2, 4), -i)) for i in range(12)]
    monkeypatch.setattr(moepar.data.sources, "validation_batches", lambda *a, **k: windows)
    for dims in (ParallelDims(4, dp=4), ParallelDims(4, dp=2, tp=2), ParallelDims(4, pp=2, dp=2)):
        shares = {}
        for rank in range(4):
            ids = [[int(x[0, 0]) for x, _ in r] for r in Validation(cfg, dims, rank).rounds]
            assert shares.setdefault(dims.coords(rank).dp, ids) == ids   # same dp, same batches
        local = 4 // dims.dp
        assert shares == {d: [[r * 4 + d * local + j for j in range(local)] for r in range(3)]
                          for d in range(dims.dp)}


def test_bad_validation_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"train.eval_every=-1 must be >= 0"):
        tiny_config(tmp_path, "--train.eval_every=-1")
    with pytest.raises(ValueError, match=r"train.eval_batches=0 must be >= 1"):
        tiny_config(tmp_path, "--train.eval_batches=0")
    cfg = tiny_config(tmp_path / "run", "--train.eval_every=5")
    with pytest.raises(ValueError, match=r"validation \(train.eval_batches=1\): "
                                         r"data.source=builtin: only folders from `moepar data "
                                         r"prepare` have a validation split"):
        Trainer(cfg, log=lambda _m: None)
    data = byte_folder(tmp_path)
    cfg = tiny_config(tmp_path / "run", "--train.eval_every=5", "--train.eval_batches=500",
                      "--data.source=tokens", f"--data.path={data}")
    with pytest.raises(ValueError, match=r"the validation split has \d+ tokens, fewer than 2000 "
                                         r"windows"):
        Trainer(cfg, log=lambda _m: None)


def test_perplexity_and_tensorboard_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moepar.layers import ModelConfig
    from moepar.metrics import MetricsWriter
    assert perplexity(math.log(7.5)) == pytest.approx(7.5) and perplexity(800.0) == math.inf
    writer = MetricsWriter(str(tmp_path), True, model=ModelConfig(num_layers=2))
    writer.write({"step": 1, "loss": 3.0})
    writer.write({"step": 2, "loss": 2.0, "val_loss": 2.5, "val_ppl": math.exp(2.5)})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 2.5)]
    assert events.Scalars("val/ppl")[0].value == pytest.approx(math.exp(2.5))
    assert not any(t.startswith("train/val") for t in events.Tags()["scalars"])
