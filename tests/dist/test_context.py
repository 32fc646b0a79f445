"""Context parallelism: float64 training steps with sequences split over cp ranks (two
load-balanced chunks each) equal the single-process steps: losses, grad norms, aux losses, drops
and the saved parameters (the parity harness of test_parity.py, with its capacity, z-loss,
sequence balance loss and expert bias)."""

import pytest

from test_parity import check_parity, reference

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
], ids=str)
def test_cp_parity(worlds, tmp_path, single, size, overrides):
    check_parity(worlds, tmp_path, single, size, overrides)


def test_cp_mla_parity(worlds, tmp_path, single_mla):
    """MLA gathers its latent and rotated key part, not the expanded keys and values."""
    check_parity(worlds, tmp_path, single_mla, 2, [*MLA, "--parallel.cp=2", "--parallel.ep=2"])
