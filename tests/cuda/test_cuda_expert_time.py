"""On a GPU: the straggler view's expert time (moepar/experttime.py) comes from CUDA events
around each MoE layer's experts, read after the metrics flush that ends the window, and lands
in expert_load.jsonl one log window later."""

import json

import pytest

from configs import tiny_config
from moepar.train import Trainer

pytestmark = pytest.mark.cuda


def test_expert_time_from_cuda_events(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=4", "--train.device=cuda",
                                  "--run.log_every=2"), log=lambda _m: None)
    assert trainer.expert_timer.cuda
    trainer.run()
    lines = (tmp_path / "expert_load.jsonl").read_text().splitlines()[1:]
    steps = {json.loads(line)["step"]: json.loads(line) for line in lines}
    # Log steps 1, 2, 4: step 2 has step 1's window, step 4 step 2's (the lag), step 1 none.
    assert [s for s, r in sorted(steps.items()) if "expert_ms" in r] == [2, 4]
    for step in (2, 4):
        ms_LP = steps[step]["expert_ms"]
        assert len(ms_LP) == 2 and all(len(row) == 1 and row[0] > 0 for row in ms_LP)
