"""The training loop: it learns, resumes bit for bit, skips non-finite steps, and keeps its files."""

import copy
import json
import math
import os

import pytest
import torch

from configs import tiny_config
from moepar.metrics import StepStats
from moepar.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from moepar.train import NonFiniteError, Trainer, lr_at


def quiet(_msg):
    pass


def test_overfits_one_small_batch(tmp_path):
    """Repeating one micro-batch, the loss must fall far below ln(256) = 5.55 (uniform guess)."""
    cfg = tiny_config(tmp_path, "--train.steps=60", "--train.global_batch_size=2",
                      "--train.warmup_steps=5", "--train.lr=1e-2", "--router.capacity_factor=none")
    trainer = Trainer(cfg, log=quiet)
    inputs, targets = trainer.sampler.batch(0)
    trainer.sampler.batch = lambda index: (inputs, targets)
    records = trainer.run()
    assert records[0]["loss"] > 5.0
    assert records[-1]["loss"] < 0.5, [round(r["loss"], 3) for r in records[::10]]


def test_lr_schedule_hand_values(tmp_path):
    cfg = tiny_config(tmp_path, "--train.steps=10", "--train.warmup_steps=2", "--train.lr=1.0",
                      "--train.min_lr_ratio=0.1").train
    assert lr_at(1, cfg) == pytest.approx(0.5)
    assert lr_at(2, cfg) == pytest.approx(1.0)
    # halfway through the 8 decay steps: floor + (1 - floor) * 0.5 * (1 + cos(pi/2))
    assert lr_at(6, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(10, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("extra", [[], ["--train.dtype=float64", "--router.bias_update_rate=0.01",
                                        "--router.score_func=sigmoid"]])
def test_resume_is_bit_exact(tmp_path, extra):
    full = Trainer(tiny_config(tmp_path / "full", "--train.steps=6", *extra), log=quiet).run()
    first = Trainer(tiny_config(tmp_path / "part", "--train.steps=6", "--run.checkpoint_every=3",
                                *extra), log=quiet)
    # Stop after step 3 as a crash would (the step-3 checkpoint is on disk).
    for _ in range(3):
        first.train_step()
    first.save()
    resumed = Trainer(tiny_config(tmp_path / "part", "--train.steps=6", "--run.resume=true", *extra),
                      log=quiet)
    assert resumed.step == 3 and resumed.sampler.position == 3 * 2
    tail = resumed.run()
    assert [r["loss"] for r in tail] == [r["loss"] for r in full[3:]]
    assert [r["grad_norm"] for r in tail] == [r["grad_norm"] for r in full[3:]]
    lines = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 5, 6]


def test_resume_restores_model_and_optimizer(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=2"), log=quiet)
    trainer.run()
    fresh = Trainer(tiny_config(tmp_path, "--train.steps=2", "--run.resume=true"), log=quiet)
    for (name, a), b in zip(trainer.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(trainer.model.parameters(), fresh.model.parameters()):
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(trainer.optimizer.state[p][kind], fresh.optimizer.state[q][kind])


def test_nonfinite_step_is_skipped_and_parameters_untouched(tmp_path):
    trainer = Trainer(tiny_config(tmp_path), log=quiet)
    trainer.train_step()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    exp_avg = {id(p): trainer.optimizer.state[p]["exp_avg"].clone() for p in trainer.model.parameters()}
    real_forward = trainer.model.forward

    def poisoned(tokens, *args, **kwargs):   # the final hidden states (or logits), poisoned
        out, outs = real_forward(tokens, *args, **kwargs)
        return out * float("nan"), outs

    trainer.model.forward = poisoned
    messages = []
    trainer.log = messages.append
    record = trainer.train_step()
    assert record["skipped"] and math.isnan(record["loss"])
    assert any("non-finite" in m and "skipped" in m for m in messages)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p in trainer.model.parameters():
        assert torch.equal(trainer.optimizer.state[p]["exp_avg"], exp_avg[id(p)])
        assert p.grad is None
    trainer.model.forward = real_forward
    assert not trainer.train_step()["skipped"]


def test_nonfinite_stop_raises(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.on_nonfinite=stop"), log=quiet)
    trainer.model.embed.weight.data.fill_(float("inf"))
    with pytest.raises(NonFiniteError, match="non-finite"):
        trainer.train_step()


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """Two accumulated micro-batches give the gradient of the mean of their (loss + aux losses)."""
    cfg = tiny_config(tmp_path, "--train.dtype=float64", "--router.capacity_factor=none",
                      "--router.z_coeff=0.001")
    trainer = Trainer(cfg, log=quiet)
    batches = [trainer.sampler.batch(i) for i in range(2)]
    # Independent reference: each micro-batch's loss + aux losses, weighted 1/2, by plain autograd.
    ref = copy.deepcopy(trainer.model)
    for moe in ref.moe_layers():
        moe.aux_loss_scale = None
    total = 0
    for inputs, targets in batches:
        logits, outs = ref(inputs)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        total = total + (ce + sum(o.aux_loss.total for o in outs)) / 2
    total.backward()
    stats = StepStats(len(trainer.model.moe_layers()), 4)
    for inputs, targets in batches:
        trainer._micro_batch(inputs, targets, stats)
    for (name, p), q in zip(trainer.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_run_directory_and_checkpoint_files(tmp_path):
    cfg = tiny_config(tmp_path, "--train.steps=4", "--run.checkpoint_every=2",
                      "--run.keep_checkpoints=1", "--run.tensorboard=true")
    Trainer(cfg, log=quiet).run()
    assert (tmp_path / "config.toml").exists() and (tmp_path / "tb").is_dir()
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens_per_s", "drop_fraction",
                "max_load_ratio"):
        assert all(math.isfinite(r[key]) for r in records), key
    ckpts = sorted(os.listdir(tmp_path / "checkpoints"))
    assert ckpts == ["step_4"], ckpts
    files = sorted(os.listdir(tmp_path / "checkpoints" / "step_4"))
    assert files == ["index.json", "manifest.json", "model-r00000.safetensors",
                     "optimizer-r00000.safetensors", "rng-r00000.safetensors", "state.json"]
    index = json.loads((tmp_path / "checkpoints" / "step_4" / "index.json").read_text())
    # Layout-free names: experts by global id, no stacked [E, ...] tensors.
    assert "layers.0.ffn.experts.3.w_in" in index["model"]
    assert "exp_avg/layers.1.ffn.experts.0.w_out" in index["optimizer"]
    assert not any("w_in_EDU" in name for name in index["model"])
    assert not any(f.endswith(".pt") or f.endswith(".bin") for f in files)


def test_interrupted_checkpoint_is_never_loaded(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=2"), log=quiet)
    trainer.run()
    root = tmp_path / "checkpoints"
    # A crash mid-write leaves only the temporary directory behind.
    (root / ".step_9.tmp").mkdir()
    (root / ".step_9.tmp" / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(str(root)).endswith("step_2")
    # A committed checkpoint whose file was altered is refused, naming the file.
    model_file = root / "step_2" / "model-r00000.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model-r00000.safetensors"):
        load_checkpoint(str(root / "step_2"), trainer.model)


def test_fresh_run_refuses_to_clobber_checkpoints(tmp_path):
    Trainer(tiny_config(tmp_path, "--train.steps=1"), log=quiet).run()
    with pytest.raises(ValueError, match="run.resume"):
        Trainer(tiny_config(tmp_path, "--train.steps=1"), log=quiet)


def test_bfloat16_and_checkpointing_train(tmp_path):
    cfg = tiny_config(tmp_path, "--train.dtype=bfloat16", "--train.activation_checkpointing=true",
                      "--train.steps=3")
    records = Trainer(cfg, log=quiet).run()
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in records)


def test_expert_choice_and_shared_experts_train(tmp_path):
    cfg = tiny_config(tmp_path, "--router.type=expert_choice", "--router.capacity_factor=1.0",
                      "--model.num_shared_experts=1", "--model.shared_gate=true", "--train.steps=3")
    records = Trainer(cfg, log=quiet).run()
    assert all(math.isfinite(r["loss"]) for r in records)


def test_token_out_of_vocabulary_refused_at_load(tmp_path):
    import numpy as np
    tokens = np.arange(5000, dtype=np.uint16) % 300    # ids up to 299
    np.save(tmp_path / "tokens.npy", tokens)
    cfg = tiny_config(tmp_path / "run", "--data.source=tokens", f"--data.path={tmp_path / 'tokens.npy'}",
                      "--model.vocab_size=280")
    with pytest.raises(ValueError, match=r"token id 299 at position 299 .*vocab_size=280"):
        Trainer(cfg, log=quiet)
    assert not (tmp_path / "run").exists()


def test_deepseek_style_model_trains(tmp_path):
    """MLA attention, sigmoid group-limited routing with the aux-loss-free bias, shared experts."""
    cfg = tiny_config(tmp_path, "--model.attention=mla", "--model.q_lora_rank=16",
                      "--model.kv_lora_rank=12", "--model.qk_nope_head_dim=8",
                      "--model.qk_rope_head_dim=4", "--model.v_head_dim=6", "--model.num_experts=8",
                      "--model.first_k_dense=1", "--model.num_shared_experts=1",
                      "--router.score_func=sigmoid", "--router.n_group=2", "--router.topk_group=1",
                      "--router.norm_topk_prob=true", "--router.routed_scaling_factor=2.5",
                      "--router.bias_update_rate=0.01", "--router.balance_coeff=0", "--train.steps=3")
    trainer = Trainer(cfg, log=quiet)
    records = trainer.run()
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in records)
    assert trainer.expert_bias_LE().abs().sum() > 0    # the bias moved with the load


def test_async_checkpoint_holds_the_step_it_was_taken_at(tmp_path):
    """A background save snapshots the step it is taken at while training goes on: its files
    equal a blocking save's, bit for bit, and the run resumes from it exactly."""
    from moepar.checkpoint import read_canonical
    args = ["--train.steps=4", "--run.checkpoint_every=2", "--router.bias_update_rate=0.01"]
    blocking = Trainer(tiny_config(tmp_path / "sync", *args), log=quiet).run()
    logged = []
    background = Trainer(tiny_config(tmp_path / "async", *args, "--run.async_checkpoint=true"),
                         log=logged.append)
    assert [r["loss"] for r in background.run()] == [r["loss"] for r in blocking]
    assert any("writing in the background" in line for line in logged)
    for step in (2, 4):
        want = dict(read_canonical(str(tmp_path / "sync" / "checkpoints" / f"step_{step}")))
        got = dict(read_canonical(str(tmp_path / "async" / "checkpoints" / f"step_{step}")))
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
    resumed = Trainer(tiny_config(tmp_path / "async", *args, "--train.steps=4",
                                  f"--run.resume_from={tmp_path}/async/checkpoints/step_2",
                                  "--run.overwrite=true"), log=quiet)
    assert [r["loss"] for r in resumed.run()] == [r["loss"] for r in blocking[2:]]
