"""Expert placement and replication (parallel.expert_placement, parallel.expert_replicas): float64
steps at any placement, with or without replica slots, equal the single-process steps (loss, grad
norm, the checkpointed parameters, which stay canonical), and a checkpoint saved at one placement
resumes exactly at another."""

import math

import pytest
import torch
import torch.distributed as dist

from configs import tiny_config
from moepar.checkpoint import load_checkpoint
from moepar.expert_placement import write_placement
from moepar.layers import Transformer
from moepar.parallel.expert import moe_layers_by_id
from moepar.parallel.expert_map import ExpertMap
from moepar.train import Trainer

STEPS = 3
COMMON = ["--train.dtype=float64", f"--train.steps={STEPS}", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--model.num_experts=8", "--router.capacity_factor=1.0",
          "--router.bias_update_rate=0.001", "--router.seq_balance_coeff=0.01"]

# Hand-written placements of 8 experts: the experts each rank owns, then its replica slots (ep 4,
# rank 2 holds a replica of an expert it owns, the degenerate case).
PLACEMENTS = {
    "ep2": [[5, 0, 3, 6], [1, 2, 4, 7]],
    "ep4": [[7, 2], [0, 5], [3, 6], [1, 4]],
    "ep2_rep": [[5, 0, 3, 6, 1], [1, 2, 4, 7, 5]],
    "ep4_rep": [[7, 2, 0], [0, 5, 7], [3, 6, 3], [1, 4, 2]],
}


def quiet(_msg):
    pass


def summary(records):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def placement_file(tmp_path, name: str) -> str:
    """`name`'s placement for both MoE layers of the tiny model (layers 0 and 1)."""
    ranks = PLACEMENTS[name]
    path = str(tmp_path / f"{name}.json")
    slots = tuple(e for r in ranks for e in r)
    write_placement(path, {layer: ExpertMap(slots, 8, len(ranks)) for layer in (0, 1)})
    return path


def case_train(run_dir: str, overrides: list[str]):
    records = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=quiet).run()
    dist.barrier()
    return summary(records)


def case_resume(run_dir: str, overrides: list[str], path: str):
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides, f"--run.resume_from={path}"),
                      log=quiet)
    records = [trainer.train_step() for _ in range(STEPS - trainer.step)]
    dist.barrier()
    return summary(records)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process run (also the measured load `balanced` reads): (run dir, trainer,
    records)."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    trainer = Trainer(tiny_config(run_dir, *COMMON, "--run.checkpoint_every=0"), log=quiet)
    return str(run_dir), trainer, summary(trainer.run())


def assert_records(got, want):
    assert [s for s, _, _ in got] == [s for s, _, _ in want], (got, want)
    for (_, loss, gnorm), (_, w_loss, w_gnorm) in zip(got, want, strict=True):
        assert math.isclose(loss, w_loss, rel_tol=1e-9), (got, want)
        assert math.isclose(gnorm, w_gnorm, rel_tol=1e-9), (got, want)


@pytest.mark.parametrize("size, ep, name, extra", [
    (2, 2, "ep2", []), (4, 4, "ep4", []), (2, 2, "ep2_rep", ["--parallel.expert_replicas=1"]),
    (4, 4, "ep4_rep", ["--parallel.expert_replicas=1", "--parallel.a2a_chunks=3"]),
    (4, 4, "balanced", ["--parallel.expert_replicas=2", "--parallel.dispatcher=dedup",
                        "--parallel.zero=1"]),
    # Replica weights fetched inside FSDP2's unsharded forward, and recomputed experts.
    (2, 2, "ep2_rep", ["--parallel.expert_replicas=1", "--parallel.zero=3",
                       "--train.recompute=experts"]),
    # A placement per layer on pipeline stages, and EP groups folded over tensor parallelism.
    (4, 2, "ep2_rep", ["--parallel.pp=2", "--parallel.expert_replicas=1", "--parallel.zero=2"]),
    (4, 2, "ep2_rep", ["--parallel.tp=2", "--parallel.expert_replicas=1"]),
], ids=["ep2", "ep4", "ep2_replicas", "ep4_replicas_chunks", "ep4_balanced_replicas_dedup",
        "ep2_replicas_zero3_recompute", "pp2_ep2_replicas_zero2", "tp2_ep2_replicas"])
def test_placement_parity(worlds, tmp_path, single, size, ep, name, extra):
    single_dir, ref, ref_records = single
    where = (["--parallel.expert_placement=balanced", f"--parallel.placement_from={single_dir}"]
             if name == "balanced" else
             [f"--parallel.expert_placement={placement_file(tmp_path, name)}"])
    run_dir = str(tmp_path / "run")
    overrides = [f"--parallel.ep={ep}", *where, *extra, f"--run.checkpoint_every={STEPS}"]
    results = worlds(size).run(case_train, run_dir, overrides, timeout=120)
    for rank_records in results:
        assert_records(rank_records, ref_records)
    assert_checkpoint(run_dir, ref)


def assert_checkpoint(run_dir: str, ref):
    """The checkpoint names experts by logical id: it loads into one process as the reference."""
    model = Transformer(ref.cfg.model, ref.cfg.router).double()
    load_checkpoint(f"{run_dir}/checkpoints/step_{STEPS}", model)
    for (name, p), q in zip(model.state_dict().items(), ref.model.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)


def case_replace(run_dir: str, overrides: list[str]):
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=quiet)
    owned = [m.experts.expert_ids for _, m in moe_layers_by_id(trainer.model)]
    records = trainer.run()
    dist.barrier()
    return summary(records), owned, [m.experts.expert_ids for _, m in
                                     moe_layers_by_id(trainer.model)]


@pytest.mark.parametrize("size, name, extra", [
    (2, "", []), (4, "ep4_rep", ["--parallel.expert_replicas=1"])], ids=["ep2", "ep4_replicas"])
def test_replace_every_step_is_exact(worlds, tmp_path, single, size, name, extra):
    """parallel.replace_every=1: after every step the experts (weights and AdamW moments) move
    to the balanced placement of that step's load; the run still equals one process."""
    _, ref, ref_records = single
    start = [f"--parallel.expert_placement={placement_file(tmp_path, name)}"] if name else []
    run_dir = str(tmp_path / "run")
    overrides = [f"--parallel.ep={size}", "--parallel.replace_every=1", *start, *extra,
                 f"--run.checkpoint_every={STEPS}"]
    results = worlds(size).run(case_replace, run_dir, overrides, timeout=120)
    for records, _, _ in results:
        assert_records(records, ref_records)
    assert any(first != last for _, first, last in results), "no expert moved"
    assert_checkpoint(run_dir, ref)


def test_resume_at_another_placement(worlds, tmp_path, single):
    """Saved at step 2 under one placement, resumed under another (other experts owned, replica
    slots): step 3 is the single process's step 3."""
    _, _, ref_records = single
    first = [f"--parallel.expert_placement={placement_file(tmp_path, 'ep2')}", "--parallel.ep=2",
             "--run.checkpoint_every=2"]
    worlds(2).run(case_train, str(tmp_path / "a"), first, timeout=120)
    other = [f"--parallel.expert_placement={placement_file(tmp_path, 'ep2_rep')}",
             "--parallel.ep=2", "--parallel.expert_replicas=1", "--run.checkpoint_every=0"]
    results = worlds(2).run(case_resume, str(tmp_path / "b"), other,
                            str(tmp_path / "a" / "checkpoints" / "step_2"), timeout=120)
    for rank_records in results:
        assert_records(rank_records, ref_records[2:])
