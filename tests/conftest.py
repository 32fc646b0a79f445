"""Shared fixtures; tiny configs live in configs.py (importable from every test folder)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_state():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: skipped (not failed) where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
