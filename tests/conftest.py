"""Shared fixtures; tiny configs live in configs.py (importable from every test folder)."""

import os
import tempfile

import pytest
import torch

# Inductor's compiled kernels go to a folder of this run (its workers and subprocesses inherit
# it): the default, /tmp/torchinductor_<user>, is shared by every run on the machine, and a run
# killed mid-compile leaves a truncated .so there that the next run imports ("file too short").
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="moepar-inductor-"))


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
