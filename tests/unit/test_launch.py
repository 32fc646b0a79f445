"""Device choice and backend checks (moepar/process.py), as pure functions: no GPU needed."""

import pytest
import torch

from moepar.process import device_index, select_device


def test_local_rank_wins_then_rank_modulo_devices():
    assert device_index({"LOCAL_RANK": "3", "RANK": "11"}, 8) == 3
    # SLURM's srun sets RANK and WORLD_SIZE only: rank 11 on 8-GPU nodes is cuda:3, not cuda:0
    assert device_index({"RANK": "11", "WORLD_SIZE": "16"}, 8) == 3
    assert device_index({}, 4) == 0
    with pytest.raises(ValueError, match="LOCAL_RANK=8 but this node has 8 CUDA device"):
        device_index({"LOCAL_RANK": "8"}, 8)


def test_select_device():
    assert select_device("auto", env={}, cuda_count=0) == torch.device("cpu")
    assert select_device("cpu", env={"RANK": "5"}, cuda_count=8) == torch.device("cpu")
    assert select_device("auto", env={"RANK": "13"}, cuda_count=4) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="CUDA is not available"):
        select_device("cuda", env={}, cuda_count=0)


def test_backend_that_cannot_carry_the_device_is_refused():
    with pytest.raises(ValueError, match="gloo's all-to-all carries CPU tensors only"):
        select_device("auto", "gloo", env={"LOCAL_RANK": "0"}, cuda_count=1)
    with pytest.raises(ValueError, match="NCCL needs CUDA tensors"):
        select_device("auto", "nccl", env={}, cuda_count=0)
