"""What a run writes about its experts: expert_load.jsonl (trimmed on resume like metrics.jsonl),
TensorBoard tags by model layer number, and the heatmap image every run.tb_image_every steps."""

import json

import numpy as np
import pytest
import torch

from configs import tiny_config
from moepar.config import load_config
from moepar.layers import ModelConfig
from moepar.metrics import LOAD_FILE, MetricsWriter, StepStats, imbalance_L, moe_layer_numbers
from moepar.train import Trainer


def quiet(_msg):
    pass


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("kwargs, expected", [
    (dict(num_layers=4, first_k_dense=1), [1, 2, 3]),
    (dict(num_layers=6, first_k_dense=0, moe_every=2), [0, 2, 4]),
    (dict(num_layers=6, first_k_dense=1, moe_every=2, moe_offset=1), [2, 4]),
    (dict(num_layers=5, first_k_dense=1, dense_layers=[3]), [1, 2, 4]),
])
def test_moe_layer_numbers_are_model_layers(kwargs, expected):
    assert moe_layer_numbers(ModelConfig(**kwargs)) == expected


def test_imbalance_over_steps_and_layers_matches_hand_values():
    tokens_SLE = torch.tensor([[[1.0, 1.0, 4.0, 2.0], [0.0, 0.0, 0.0, 0.0]],
                               [[2.0, 2.0, 2.0, 2.0], [8.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    ratio, cv = imbalance_L(tokens_SLE)
    # mean 2: max/mean 2, std sqrt(((1-2)^2*2 + 2^2 + 0)/4) = sqrt(1.5); an empty layer gives 0
    assert ratio.tolist() == [[2.0, 0.0], [1.0, 4.0]]
    torch.testing.assert_close(cv, torch.tensor([[1.5 ** 0.5 / 2, 0.0], [0.0, 3 ** 0.5]],
                                                dtype=torch.float64))


def stats_with(tokens_LE, dropped_L, assigned_L):
    stats = StepStats(len(tokens_LE), len(tokens_LE[0]))
    stats.tokens_LE += torch.tensor(tokens_LE, dtype=torch.float64)
    stats.dropped_L += torch.tensor(dropped_L, dtype=torch.float64)
    stats.assignments_L += torch.tensor(assigned_L, dtype=torch.float64)
    return stats


MODEL = ModelConfig(num_layers=4, first_k_dense=2, num_experts=3)   # MoE layers 2 and 3


def write_steps(run_dir, steps, resume_step=0, model=MODEL, torn=None):
    writer = MetricsWriter(str(run_dir), False, resume_step=resume_step, model=model)
    for step in steps:
        stats = stats_with([[step, 0, 2], [1, 1, step]], [step % 2, 0], [step + 2, step + 2])
        bias = torch.tensor([[0.5, -0.25, 0.0], [step * 1e-3, 0.0, -step * 1e-3]])
        writer.write({"step": step, "loss": 1.0}, stats, bias)
    writer.close()
    if torn:
        with open(run_dir / LOAD_FILE, "a") as f:
            f.write(torn)


def test_load_file_holds_header_and_every_step(tmp_path):
    write_steps(tmp_path, [1, 2])
    header, *records = read_lines(tmp_path / LOAD_FILE)
    assert header == {"format": "moepar.expert_load", "version": 1, "layers": [2, 3],
                      "num_experts": 3}
    assert records == [
        {"step": 1, "tokens": [[1, 0, 2], [1, 1, 1]], "dropped": [1, 0], "assigned": [3, 3],
         "bias": [[0.5, -0.25, 0.0], [0.001, 0.0, -0.001]]},
        {"step": 2, "tokens": [[2, 0, 2], [1, 1, 2]], "dropped": [0, 0], "assigned": [4, 4],
         "bias": [[0.5, -0.25, 0.0], [0.002, 0.0, -0.002]]}]
    # counts are written as JSON integers, not 1.0
    assert '"tokens":[[1,0,2]' in (tmp_path / LOAD_FILE).read_text()


def test_load_file_is_trimmed_on_resume_like_metrics(tmp_path):
    write_steps(tmp_path, [1, 2, 3, 4], torn='{"step": 5, "tokens": [[5, 0')
    write_steps(tmp_path, [3], resume_step=2)
    header, *records = read_lines(tmp_path / LOAD_FILE)
    assert header["layers"] == [2, 3]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["step"] for r in read_lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_fresh_run_and_other_model_start_the_load_file_over(tmp_path):
    write_steps(tmp_path, [1, 2])
    write_steps(tmp_path, [1])                       # not a resume: old lines go
    assert [r.get("step") for r in read_lines(tmp_path / LOAD_FILE)] == [None, 1]
    other = ModelConfig(num_layers=4, first_k_dense=1, num_experts=3)
    MetricsWriter(str(tmp_path), False, resume_step=1, model=other).close()
    assert read_lines(tmp_path / LOAD_FILE) == [
        {"format": "moepar.expert_load", "version": 1, "layers": [1, 2, 3], "num_experts": 3}]


def test_tensorboard_names_layers_by_model_number_and_draws_every_n_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    writer = MetricsWriter(str(tmp_path), True, ep=3, model=MODEL, image_every=3)
    for step in range(1, 8):
        stats = stats_with([[4, 1, 1], [2, 2, 2]], [0, 1], [6, 6])
        writer.write({"step": step, "loss": 1.0}, stats, torch.zeros(2, 3))
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()
    assert {"tokens_per_expert/layer_2", "tokens_per_expert/layer_3", "expert_bias/layer_2",
            "expert_bias/layer_3"} <= set(tags["histograms"])
    for name in ("imbalance/max_over_mean", "imbalance/cv", "dropped_fraction"):
        assert {f"{name}/layer_2", f"{name}/layer_3"} <= set(tags["scalars"])
    assert not any("layer_0" in t or "layer_1" in t for t in tags["scalars"] + tags["histograms"])
    assert events.Scalars("imbalance/max_over_mean/layer_2")[0].value == pytest.approx(2.0)
    assert events.Scalars("dropped_fraction/layer_3")[0].value == pytest.approx(1 / 6)
    # Per EP rank: a histogram (bucket r = rank r), one scalar for the busiest over the mean.
    assert list(events.Histograms("ep_rank_rows/layer_2")[0].histogram_value.bucket) == [4, 1, 1]
    assert events.Scalars("views/rank_rows/layer_2")[0].value == pytest.approx(2.0)
    for tag in ("load/layer_x_expert", "load/layer_x_ep_rank"):
        images = events.Images(tag)
        assert [i.step for i in images] == [1, 3, 6]
        # heatmap_size(2 layers, 3 columns): width max(5, 2.75) + 1.25 in, height max(3, 2) in
        assert {(i.width, i.height) for i in images} == {(625, 300)}


def test_tb_image_every_is_validated(tmp_path):
    assert tiny_config(tmp_path).run.tb_image_every == 10
    with pytest.raises(ValueError, match="run.tb_image_every=-1 must be >= 0"):
        load_config(None, ["--run.tb_image_every=-1"])


def run_loads(run_dir):
    header, *records = read_lines(run_dir / LOAD_FILE)
    return header, records


def test_training_run_records_loads_bias_and_drops(tmp_path):
    """A real run: MoE layers 1 and 2 of 3, capacity drops, a learned expert bias."""
    rate = 0.01
    cfg = tiny_config(tmp_path, "--model.num_layers=3", "--model.first_k_dense=1",
                      "--router.capacity_factor=1.0", f"--router.bias_update_rate={rate}")
    trainer = Trainer(cfg, log=quiet)
    trainer.run()
    header, records = run_loads(tmp_path)
    assert header["layers"] == [1, 2] and header["num_experts"] == 4
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    metrics = read_lines(tmp_path / "metrics.jsonl")
    copies = 4 * 32 * 2                       # global batch x seq_len x top_k, per layer and step
    bias_LE = np.zeros((2, 4))
    for record, m in zip(records, metrics, strict=True):
        tokens_LE = np.array(record["tokens"], dtype=float)
        assert tokens_LE.sum(1).tolist() == [copies, copies]
        assert record["assigned"] == [copies, copies]
        assert m["drop_fraction"] == pytest.approx(sum(record["dropped"]) / (2 * copies))
        ratio_L = tokens_LE.max(1) / tokens_LE.mean(1)
        assert m["max_load_ratio"] == pytest.approx(ratio_L.max())
        # the sign rule, from the loads in the file: bias += rate * sign(mean - load)
        bias_LE += rate * np.sign(tokens_LE.mean(1, keepdims=True) - tokens_LE)
        np.testing.assert_allclose(record["bias"], bias_LE, atol=1e-6)
    assert sum(sum(r["dropped"]) for r in records) > 0, "capacity 1.0 should drop on this data"
    live = [m.router.expert_bias_E.tolist() for m in trainer.model.moe_layers()]
    np.testing.assert_allclose(records[-1]["bias"], live, atol=1e-6)


def test_resumed_run_rewrites_the_same_loads(tmp_path):
    """Resuming from step 2 after a crash at step 3 keeps steps 1-2 and re-records 3-4 equal to an
    uninterrupted run's (the torn line of the crash is gone)."""
    flags = ("--train.steps=4", "--run.checkpoint_every=2", "--run.keep_checkpoints=0")
    Trainer(tiny_config(tmp_path / "whole", *flags), log=quiet).run()
    _, whole = run_loads(tmp_path / "whole")
    Trainer(tiny_config(tmp_path / "cut", "--train.steps=2", *flags[1:]), log=quiet).run()
    with open(tmp_path / "cut" / LOAD_FILE, "a") as f:
        f.write(json.dumps(whole[2])[:40])
    Trainer(tiny_config(tmp_path / "cut", *flags, "--run.resume=true"), log=quiet).run()
    header, resumed = run_loads(tmp_path / "cut")
    assert header["layers"] == [0, 1]
    # expert_ms is a measured time (experttime.py), and a resumed run's first window has none.
    untimed = [[{k: v for k, v in r.items() if k != "expert_ms"} for r in rs]
               for rs in (resumed, whole)]
    assert untimed[0] == untimed[1]


def old_summary(stats) -> dict:
    """The record's router keys as they were read before the batched reads, one sync each."""
    losses = (stats.losses_3 / max(stats.num_micro_batches, 1)).tolist()
    max_ratio_L, cv_L = imbalance_L(stats.tokens_LE)
    return {"aux_loss": losses[0], "z_loss": losses[1],
            "balance": losses[2] / stats.tokens_LE.shape[0],
            "drop_fraction": float(stats.dropped_L.sum() / stats.assignments_L.sum().clamp_min(1)),
            "max_load_ratio": float(max_ratio_L.max()), "load_cv": float(cv_L.mean())}


def test_lines_written_in_batches_hold_the_per_step_values(tmp_path):
    """run.log_every=4: the statistics of steps 1-6 are read at steps 1, 4 and 6, and every line
    holds what reading each step on its own gives, keys in the usual order."""
    cfg = tiny_config(tmp_path, "--run.log_every=4", "--router.capacity_factor=1.0",
                      "--router.bias_update_rate=0.01", "--router.z_coeff=0.001")
    trainer = Trainer(cfg, log=quiet)
    want, real_step = [], trainer.train_step

    def step():
        record = real_step()
        want.append((record["step"], old_summary(trainer.last_stats),
                     trainer.last_stats.tokens_LE.tolist()))
        return record
    trainer.train_step = step
    trainer.run()
    metrics = read_lines(tmp_path / "metrics.jsonl")
    _, loads = run_loads(tmp_path)
    assert [m["step"] for m in metrics] == [r["step"] for r in loads] == [1, 2, 3, 4, 5, 6]
    for m, load, (step, summary, tokens) in zip(metrics, loads, want, strict=True):
        assert list(m)[:8] == ["step", "loss", *summary] and m["step"] == step
        assert {k: m[k] for k in summary} == summary
        assert load["tokens"] == tokens
