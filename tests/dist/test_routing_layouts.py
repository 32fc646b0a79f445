"""Routing replay across layouts: choices recorded on one process replay at dp2 ep2, and those
recorded at dp2 ep2 replay on one process, equal in float64 to the recorded run although every
replaying router has a moved bias (alone it would send every token to expert 0). The dp2 ep2
run also shows each EP rank's measured expert time in its own column."""

import json
import math

import torch
import torch.distributed as dist

from configs import tiny_config
from moepar.train import Trainer

COMMON = ["--train.dtype=float64", "--train.steps=2", "--train.global_batch_size=8",
          "--model.num_experts=4", "--router.capacity_factor=1.0",
          "--router.seq_balance_coeff=0.01", "--router.z_coeff=0.001"]
HOT = [10.0, 0.0, 0.0, 0.0]


def case_train(run_dir: str, overrides: list[str], bias=None):
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=lambda _m: None)
    if bias is not None:
        for moe in trainer.model.moe_layers():
            moe.router.expert_bias_E.copy_(torch.tensor(bias))
    records = trainer.run()
    if dist.is_initialized():
        dist.barrier()
    return [(r["loss"], r["grad_norm"], r["aux_loss"], r["drop_fraction"]) for r in records]


def test_replay_between_one_process_and_dp2_ep2(worlds, tmp_path):
    one = str(tmp_path / "one_routes")
    want = case_train(str(tmp_path / "one"), [f"--train.record_routing={one}"])
    got = worlds(2).run(case_train, str(tmp_path / "ep2"),
                        ["--parallel.ep=2", f"--train.router_replay={one}"], HOT, timeout=120)
    check(got, want)

    two = str(tmp_path / "ep2_routes")
    recorded = worlds(2).run(case_train, str(tmp_path / "ep2_rec"),
                             ["--parallel.ep=2", f"--train.record_routing={two}"], timeout=120)
    assert sorted(p.name for p in (tmp_path / "ep2_routes" / "step_00000001").iterdir()) == [
        "seq_000000-000004.safetensors", "seq_000004-000008.safetensors"]   # one file per rank
    replayed = case_train(str(tmp_path / "one_rep"), [f"--train.router_replay={two}"], HOT)
    check(recorded, replayed)
    # The straggler view: each EP rank timed its own experts, in its own column (layer x rank).
    lines = (tmp_path / "ep2_rec" / "expert_load.jsonl").read_text().splitlines()[1:]
    timed = [json.loads(line)["expert_ms"] for line in lines if "expert_ms" in line]
    assert timed and all(len(ms_P) == 2 and min(ms_P) > 0 for ms_L in timed for ms_P in ms_L)


def check(per_rank, want):
    """Every rank's records equal `want` (float64, up to the layouts' summation order)."""
    for records in per_rank:
        for got_step, want_step in zip(records, want, strict=True):
            for g, w in zip(got_step, want_step, strict=True):
                assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12), (got_step, want_step)
