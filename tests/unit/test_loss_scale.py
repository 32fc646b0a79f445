"""float16 loss scaling: GradScaler's rule by hand, a power-of-two scale that leaves float64
training bit-identical (the plumbing: loss, injected aux losses, unscaling before the norm), and
a float16 run whose overflowing first steps are skipped while the scale backs off."""

import torch

from configs import tiny_config
from moepar.loss_scale import LossScaler
from moepar.train import Trainer


def quiet(_msg):
    pass


def test_scaler_rule_by_hand():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    assert scaler.update(False) and scaler.scale == 512.0           # overflow: back off
    assert [scaler.update(True) for _ in range(2)] == [None, None]  # 2 finite steps: nothing yet
    assert scaler.update(True) and scaler.scale == 1024.0           # the 3rd: grow
    assert scaler.update(False) and scaler.scale == 512.0 and scaler.finite_steps == 0
    fixed = LossScaler(scale=8.0, dynamic=False)
    assert fixed.update(False) is None and fixed.scale == 8.0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_power_of_two_scale_is_bit_identical_in_float64(tmp_path):
    args = ["--train.dtype=float64", "--train.steps=3", "--router.capacity_factor=1.0",
            "--router.z_coeff=0.001", "--router.seq_balance_coeff=0.01"]
    plain = Trainer(tiny_config(tmp_path / "plain", *args), log=quiet)
    scaled = Trainer(tiny_config(tmp_path / "scaled", *args, "--train.loss_scale=1024"), log=quiet)
    want, got = plain.run(), scaled.run()
    for a, b in zip(want, got, strict=True):
        assert (a["loss"], a["grad_norm"], a["aux_loss"]) == (b["loss"], b["grad_norm"], b["aux_loss"])
    for (name, p), q in zip(plain.model.state_dict().items(), scaled.model.state_dict().values(),
                            strict=True):
        assert torch.equal(p, q), name


def test_float16_overflow_skips_steps_and_backs_off(tmp_path):
    logged = []
    trainer = Trainer(tiny_config(tmp_path, "--train.dtype=float16", "--train.steps=12",
                                  "--train.loss_scale=16777216"), log=logged.append)
    records = trainer.run()
    notes = [line for line in logged if "loss scale" in line and "overflowed" in line]
    skipped = [r["step"] for r in records if r["skipped"]]
    # 2^24 overflows float16 at once; each overflow (and only an overflow) halves the scale
    assert skipped[0] == 1 and len(notes) == len(skipped) < len(records)
    assert trainer.scaler.scale == 2.0 ** 24 / 2 ** len(skipped)
    trained = [r for r in records if not r["skipped"]]
    assert len(trained) >= 2 and trained[-1]["loss"] < records[0]["loss"]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
