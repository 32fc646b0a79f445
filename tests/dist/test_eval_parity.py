"""Validation loss parity: in float64 the val_loss logged during training at any layout (ep, tp,
pp, ZeRO-3; worlds of 2 and 4) equals the one-process figure to 1e-9, and `moepar eval` of a
checkpoint on another layout equals the figure logged when it was saved."""

import math
import os
import random

import pytest
import torch.distributed as dist

from configs import tiny_config
from moepar.data.prepare import PrepareOptions, prepare
from moepar.infer.evaluate import _resolve, build_parser, evaluate_checkpoint
from moepar.train import Trainer

COMMON = ["--train.dtype=float64", "--train.steps=2", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--model.num_experts=8", "--router.capacity_factor=1.0",
          "--router.bias_update_rate=0.001", "--train.eval_every=1", "--train.eval_batches=2",
          "--run.checkpoint_every=1", "--data.source=tokens"]


def case_train(run_dir: str, data: str, overrides: list[str]):
    trainer = Trainer(tiny_config(run_dir, *COMMON, f"--data.path={data}", *overrides),
                      log=lambda _m: None)
    records = trainer.run()
    dist.barrier()
    return [(r["step"], r["val_loss"]) for r in records]


def case_standalone(checkpoint: str, data: str, overrides: list[str]):
    args, _ = build_parser().parse_known_args([checkpoint, "--data", data])
    _, cfg, dims = _resolve(args, overrides, dist.get_world_size(), log=lambda _m: None)
    result = evaluate_checkpoint(cfg, dims, checkpoint)
    return result["val_loss"], result["layout"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = "the cat sat on a mat and dog ran far away from home with one red ball".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(300)]
    (tmp / "docs.txt").write_text("\n\n".join(docs))
    prepare(PrepareOptions(tokenizer="bytes", inputs=[str(tmp / "docs.txt")], out=str(tmp / "f"),
                           split_blank_lines=True, val_fraction=0.3),
            stderr=open(os.devnull, "w"))
    return str(tmp / "f")


@pytest.fixture(scope="module")
def single(tmp_path_factory, data):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    records = Trainer(tiny_config(run_dir, *COMMON, f"--data.path={data}"),
                      log=lambda _m: None).run()
    return str(run_dir), [(r["step"], r["val_loss"]) for r in records]


LAYOUTS = [
    (2, ["--parallel.ep=2"]),
    (2, ["--parallel.tp=2"]),
    (2, ["--parallel.pp=2"]),
    (2, ["--parallel.ep=2", "--parallel.zero=3"]),
    (4, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.ep=2"]),
    (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.ep=4", "--parallel.zero=3"]),
]


@pytest.mark.parametrize("size, overrides", LAYOUTS, ids=lambda v: str(v))
def test_validation_loss_is_the_same_at_every_layout(worlds, tmp_path, data, single, size,
                                                     overrides):
    _, want = single
    assert [step for step, _ in want] == [1, 2] and want[0][1] != want[1][1]
    results = worlds(size).run(case_train, str(tmp_path / "run"), data, overrides, timeout=240)
    for got in results:               # every rank has the global figure
        for (step, g), (_, w) in zip(got, want, strict=True):
            assert math.isclose(g, w, rel_tol=1e-9), (step, g, w)


def test_standalone_eval_on_another_layout_equals_the_logged_figure(worlds, data, single):
    run_dir, want = single
    checkpoint = os.path.join(run_dir, "checkpoints", "step_1")
    results = worlds(4).run(case_standalone, checkpoint, data,
                            ["--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=1"],
                            timeout=240)
    for loss, layout in results:
        assert layout == "world 4 = pp 2 x dp 2 x tp 1; experts: pp 2 x edp 1 x ep 2"
        assert math.isclose(loss, want[0][1], rel_tol=1e-9), (loss, want[0][1])
