"""Context parallelism: float64 training steps with sequences split over cp ranks (two
load-balanced chunks each) equal the single-process steps: losses, grad norms, aux losses, drops
and the saved parameters (the parity harness of test_parity.py, with its capacity, z-loss,
sequence balance loss and expert bias)."""

import pytest

from test_parity import check_parity, reference
from test_resume_ep import F64, SAVED_STEP, STEPS, assert_continues, case_resume_from, case_run

MLA = ["--model.attention=mla", "--model.kv_lora_rank=16", "--model.q_lora_rank=16",
       "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=8", "--model.v_head_dim=8"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def single_mla(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("single_mla"), *MLA)


@pytest.mark.parametrize("size, overrides", [
    (2, ["--parallel.cp=2"]),                                  # keys/values gathered over cp
    (2, ["--parallel.cp=2", "--parallel.ep=2"]),               # experts over the cp ranks
    (4, ["--parallel.cp=2", "--parallel.tp=2"]),               # chunks split again over tp
    (4, ["--parallel.pp=2", "--parallel.cp=2", "--parallel.ep=2"]),   # stages pass chunks on
    (8, ["--parallel.cp=4", "--parallel.dp=2", "--parallel.ep=2", "--parallel.zero=3"]),
], ids=str)
def test_cp_parity(worlds, tmp_path, single, size, overrides):
    check_parity(worlds, tmp_path, single, size, overrides)


def test_cp_mla_parity(worlds, tmp_path, single_mla):
    """MLA gathers its latent and rotated key part, not the expanded keys and values."""
    check_parity(worlds, tmp_path, single_mla, 2, [*MLA, "--parallel.cp=2", "--parallel.ep=2"])


def test_cp2_checkpoint_resumes_at_cp1(worlds, tmp_path):
    """A float64 cp=2 run saves step 2; a dp=2 run (cp=1) resumes it and takes the cp=2 run's
    own next steps: checkpoints do not depend on how sequences were split."""
    run_dir = tmp_path / "cp2"
    saved = [*F64, "--parallel.cp=2", "--parallel.ep=2", f"--run.checkpoint_every={SAVED_STEP}"]
    records = worlds(2).run(case_run, str(run_dir), saved, timeout=120)[0]
    path = str(run_dir / "checkpoints" / f"step_{SAVED_STEP}")
    results = worlds(2).run(case_resume_from, str(tmp_path / "dp2"), [*F64, "--parallel.ep=2"],
                            path, STEPS - SAVED_STEP, timeout=120)
    for rank_records in results:
        assert_continues(rank_records, records)
