"""The two checks of a layout parity test: every rank's per-step numbers equal the single-process
run's, and the checkpoint the layout saved loads into one process with the reference's values."""

import math

import torch

from moepar.checkpoint import load_checkpoint
from moepar.layers import Transformer


def assert_same_steps(results: list, ref_records: list, rel: float = 1e-9):
    """`results`: per rank, per step a tuple of numbers; each equals the reference's."""
    for records in results:
        assert len(records) == len(ref_records)
        for step, (got, want) in enumerate(zip(records, ref_records, strict=True), 1):
            for g, w in zip(got, want, strict=True):
                assert math.isclose(g, w, rel_tol=rel, abs_tol=1e-12), (step, got, want)


def assert_checkpoint_equals(checkpoint: str, ref_trainer) -> dict:
    """Loads `checkpoint` into a float64 model of the reference's config; every tensor equals the
    reference trainer's. Returns the reference state dict."""
    model = Transformer(ref_trainer.cfg.model, ref_trainer.cfg.router).double()
    load_checkpoint(checkpoint, model)
    ref = ref_trainer.model.state_dict()
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, ref[name], rtol=1e-9, atol=1e-12, msg=name)
    return ref
