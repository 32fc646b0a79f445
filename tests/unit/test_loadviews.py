"""Load views (moepar/loadviews.py): hand-computed percentiles, dead experts and entropies; the
same TensorBoard scalar tags at ep 1 and ep 4; the collapse alarm in the record and the
progress line."""

import json
import math

import numpy as np
import pytest
import torch

from moepar.inspect import main as inspect_main
from moepar.inspect.report import summarize
from moepar.inspect.runload import read_run
from moepar.layers import ModelConfig
from moepar.loadviews import CollapseWatch, layer_views, rank_rows_LP
from moepar.metrics import LOAD_FILE, LOAD_FORMAT, MetricsWriter, StepStats
from moepar.parallel.expert_map import ExpertMap
from moepar.progress import progress_line

MODEL = ModelConfig(num_layers=2, num_experts=8, top_k=2, dim=32, num_heads=4, num_kv_heads=2,
                    vocab_size=64, max_seq_len=16)


def test_views_by_hand():
    tokens_LE = np.array([[0, 0, 2, 2, 4, 4, 4, 16],
                          [4, 4, 4, 4, 4, 4, 4, 4.0]])
    v = layer_views(tokens_LE, ep=4, entropy_L=[0.5, 1.0])
    # Layer 0: mean 4, so loads over the mean are 0 0 .5 .5 1 1 1 4.
    assert v["p50"][0] == pytest.approx(0.75)               # between the 4th and 5th: .5 and 1
    assert v["p90"][0] == pytest.approx(1 + 0.3 * 3)          # numpy's linear: 1 + (6.3-6)*(4-1)
    assert v["max_over_mean"].tolist() == [4.0, 1.0]
    assert v["dead"].tolist() == [2, 0]
    share = np.array([2, 2, 4, 4, 4, 16]) / 32
    assert v["load_entropy"][0] == pytest.approx(-(share * np.log(share)).sum() / math.log(8))
    assert v["load_entropy"][1] == pytest.approx(1.0)
    # EP ranks hold experts (0,1) (2,3) (4,5) (6,7): rows 0, 4, 8, 20 of mean 8.
    assert v["rank_rows"].tolist() == [2.5, 1.0]
    # Placed (parallel.expert_placement): layer 0's ranks hold (7,0) (6,1) (5,2) (4,3): rows
    # 16, 4, 6, 6 of mean 8; layer 1 stays contiguous (None). With a replica slot per rank,
    # expert 7's 16 rows split over its two copies (below).
    placed = ExpertMap((7, 0, 6, 1, 5, 2, 4, 3), 8, 4)
    v = layer_views(tokens_LE, ep=4, maps_L=[placed, None])
    assert v["rank_rows"].tolist() == [2.0, 1.0]
    replicated = ExpertMap((7, 0, 6, 6, 1, 7, 5, 2, 4, 4, 3, 5), 8, 4)   # owned 2, then a replica
    # experts 4-7 have 2 copies each: rows 8+0+2, 2+0+8, 2+2+2, 2+2+2
    assert rank_rows_LP(tokens_LE, 4, [replicated, None])[0].tolist() == [10, 10, 6, 6]


class Tags:
    """A SummaryWriter stand-in that keeps the tags written, by kind."""

    def __init__(self):
        self.scalars, self.other = set(), set()

    def add_scalar(self, tag, *_a, **_k):
        self.scalars.add(tag)

    def __getattr__(self, name):
        return lambda tag, *_a, **_k: self.other.add(tag)


def stats(num_experts, seed):
    s = StepStats(2, num_experts)
    s.tokens_LE += torch.randint(0, 9, (2, num_experts), generator=torch.Generator().manual_seed(
        seed)).double()
    s.assignments_L += s.tokens_LE.sum(-1)
    s.entropy_L += 3.0
    s.routed_tokens_L += 4.0
    return s


def test_scalar_tags_do_not_grow_with_ep(tmp_path):
    written = {}
    for ep in (1, 4):
        (tmp_path / f"ep{ep}").mkdir()
        writer = MetricsWriter(str(tmp_path / f"ep{ep}"), False, ep=ep, model=MODEL,
                               image_every=0)
        writer.tb = Tags()
        for step in (1, 2):
            writer.write({"step": step, "loss": 1.0}, stats(8, step))
        written[ep] = writer.tb
    assert written[1].scalars == written[4].scalars
    assert len(written[4].scalars) == 1 + 2 * 10     # loss; per MoE layer 3 load tags, 7 views
    assert "ep_rank_rows/layer_1" in written[4].other     # per-rank detail: a histogram


def test_collapse_alarm(tmp_path):
    watch = CollapseWatch([1, 3], 4, dead_steps=3, min_entropy=0.1)
    live = np.ones((2, 4))
    dead = np.array([[1, 0, 1, 1], [1, 1, 1, 1.0]])
    texts = [watch.update(t, [0.5, 0.5]) for t in (dead, dead, live, dead, dead, dead)]
    assert texts[:5] == [""] * 5                          # a live step restarts the count
    assert texts[5] == "layer 1: 1 expert dead >= 3 steps (e1)"
    assert watch.update(live, [0.5, 0.05]) == "layer 3: router entropy 0.050 < 0.100"
    # In the step's record (metrics.jsonl) and at the end of the progress line.
    writer = MetricsWriter(str(tmp_path), False, model=MODEL, dead_steps=1)
    record = {"step": 1, "loss": 1.0}
    s = stats(8, 0)
    s.tokens_LE.fill_(3.0)
    s.tokens_LE[1, 5] = 0
    writer.write(record, s)
    assert record["collapse"] == "layer 1: 1 expert dead >= 1 steps (e5)"
    line = progress_line({**record, "grad_norm": 1.0, "lr": 1e-3}, 10, 1000.0, 1.0, 9.0)
    assert line.endswith(f"| COLLAPSE {record['collapse']}")


def test_inspect_shows_views_and_collapse(tmp_path, capsys):
    """A hand-written expert_load.jsonl: expert 3 of layer 5 dead in the last 3 of 4 steps."""
    lines = [{"format": LOAD_FORMAT, "version": 1, "layers": [5], "num_experts": 4}]
    for step, tokens in enumerate([[4, 4, 4, 4], [6, 6, 4, 0], [8, 4, 4, 0], [8, 4, 4, 0]], 1):
        lines.append({"step": step, "tokens": [tokens], "dropped": [0], "assigned": [16],
                      "entropy": [0.5 if step < 4 else 0.04]})
    lines[-1]["expert_ms"] = [[2.0, 6.0]]          # EP rank 1 three times slower than rank 0
    (tmp_path / LOAD_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = read_run(str(tmp_path))
    report = summarize(run, last=2, dead_steps=3, min_entropy=0.05)
    assert report["collapse"] == ("layer 5: 1 expert dead >= 3 steps (e3), router entropy "
                                  "0.040 < 0.050")
    assert summarize(run, last=2, dead_steps=4)["collapse"] == ""     # dead 3 steps, not 4
    views = report["layers"][0]["views"]
    assert views["max_over_mean"] == pytest.approx(2.0)     # window loads 16 8 8 0, mean 8
    assert views["dead"] == 1 and views["rank_rows"] == pytest.approx(1.5)   # rows 24 and 8
    assert views["router_entropy"] == pytest.approx((0.5 + 0.04) / 2)
    assert views["straggler"] == pytest.approx(1.5)          # 6 over the mean 4
    assert inspect_main([str(tmp_path), "--dead-steps", "3"]) == 0
    assert "COLLAPSE layer 5: 1 expert dead >= 3 steps (e3)" in capsys.readouterr().out
