"""Shared fixtures; tiny configs live in configs.py (importable from every test folder)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_state():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
