"""Packed documents with padding (data.pack='documents', data.pad=true) in a dp2 ep2 layout and
a pp2 layout equal the single-process run in float64: losses (the mean over the global batch's
counted tokens, whatever rank holds them), grad norms, aux losses, drops and the updated
parameters."""

import math

import pytest
import torch
import torch.distributed as dist

from configs import packed_folder, tiny_config
from moepar.checkpoint import load_checkpoint
from moepar.layers import Transformer
from moepar.train import Trainer

STEPS = 2
COMMON = ["--train.dtype=float64", f"--train.steps={STEPS}", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--router.capacity_factor=1.0",
          "--router.bias_update_rate=0.001", "--router.z_coeff=0.001",
          "--router.seq_balance_coeff=0.01", "--run.checkpoint_every=0", "--data.source=tokens",
          "--data.pack=documents", "--data.pad=true"]


def _records(trainer):
    return [(r["loss"], r["grad_norm"], r["aux_loss"], r["drop_fraction"]) for r in trainer.run()]


def case_train(run_dir: str, data: str, layout: list[str]):
    records = _records(Trainer(tiny_config(run_dir, *COMMON, f"--data.path={data}", *layout),
                               log=lambda _m: None))
    dist.barrier()
    return records


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # Documents of 9 to 45 bytes in windows of 32: padding, cut documents and several per row.
    return packed_folder(tmp_path_factory.mktemp("packed_docs"), 80)


@pytest.fixture(scope="module")
def single(tmp_path_factory, data):
    ref = Trainer(tiny_config(tmp_path_factory.mktemp("ref"), *COMMON, f"--data.path={data}"),
                  log=lambda _m: None)
    return ref, _records(ref)


@pytest.mark.parametrize("layout", [["--parallel.ep=2"], ["--parallel.pp=2"]], ids=str)
def test_packed_layout_equals_one_process(worlds, tmp_path, data, single, layout):
    ref, want = single
    run_dir = str(tmp_path / "run")
    for got in worlds(2).run(case_train, run_dir, data, layout, timeout=120):
        for step, (g_rec, w_rec) in enumerate(zip(got, want, strict=True), 1):
            for g, w in zip(g_rec, w_rec, strict=True):
                assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12), (step, g_rec, w_rec)
    model = Transformer(ref.cfg.model, ref.cfg.router).double()
    load_checkpoint(f"{run_dir}/checkpoints/step_{STEPS}", model)
    for (name, p), q in zip(model.state_dict().items(), ref.model.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)
