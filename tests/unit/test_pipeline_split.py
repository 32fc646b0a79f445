"""Pipeline maths without processes: the layer split, the schedules' orders and lock-step grid
(bubble, micro-batches alive), the stage module against the full model, and the runner on one
pipeline rank (pp=1, with and without virtual chunks) against plain gradient accumulation."""

import copy

import pytest
import torch
import torch.nn.functional as F

from configs import tiny_model, token_batches
from moepar.parallel.pipeline import apply_pp, rank_chunks, split_layers
from moepar.parallel.pipeline_runner import PipelineRunner
from moepar.parallel.schedules import (Action, check_schedule, ideal_bubble,
                                       peak_in_flight, rank_order, timetable)


@pytest.mark.parametrize("layers, pp, virtual, want", [
    (5, 2, 1, [3, 2]), (4, 2, 1, [2, 2]), (7, 3, 1, [3, 2, 2]), (4, 4, 1, [1, 1, 1, 1]),
    (8, 2, 2, [2, 2, 2, 2]), (5, 2, 2, [2, 1, 1, 1]), (3, 1, 1, [3])])
def test_balanced_split(layers, pp, virtual, want):
    assert split_layers(layers, pp, virtual) == want


def test_user_split_and_errors():
    assert split_layers(5, 2, pp_layers=[1, 4]) == [1, 4]
    with pytest.raises(ValueError, match=r"sums to 6, but model.num_layers=5"):
        split_layers(5, 2, pp_layers=[3, 3])
    with pytest.raises(ValueError, match=r"has 2 entries.*parallel.pp=2 \* parallel.pp_virtual=2 = 4"):
        split_layers(5, 2, 2, pp_layers=[3, 2])
    with pytest.raises(ValueError, match=r">= 1 layer"):
        split_layers(5, 2, pp_layers=[5, 0])
    with pytest.raises(ValueError, match=r"model.num_layers=3 is fewer.*pp=2 \* parallel.pp_virtual=2 = 4"):
        split_layers(3, 2, 2)


def test_rank_chunks():
    assert rank_chunks(0, 2, 2) == [0, 2] and rank_chunks(1, 2, 2) == [1, 3]
    assert rank_chunks(2, 4) == [2]
    with pytest.raises(ValueError, match="pp rank 2 outside parallel.pp=2"):
        rank_chunks(2, 2)


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"\(6\) to be a multiple of pp=4"):
        check_schedule("interleaved_1f1b", 4, 2, 6)
    with pytest.raises(ValueError, match="2 virtual stages per rank need schedule 'interleaved_1f1b'"):
        check_schedule("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="is not one of"):
        check_schedule("zero_bubble", 2, 1, 4)
    with pytest.raises(ValueError, match=">= 1 micro-batch"):
        check_schedule("gpipe", 2, 1, 0)


LAYOUTS = [("gpipe", 2, 1, 4), ("gpipe", 3, 1, 5), ("1f1b", 2, 1, 4), ("1f1b", 4, 1, 8),
           ("1f1b", 4, 1, 2), ("1f1b", 3, 1, 7), ("interleaved_1f1b", 2, 2, 4),
           ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 4, 2, 4),
           ("interleaved_1f1b", 2, 3, 6), ("interleaved_1f1b", 1, 2, 3)]


@pytest.mark.parametrize("schedule, pp, virtual, m", LAYOUTS, ids=str)
def test_timetable_runs_every_action_once_after_its_inputs(schedule, pp, virtual, m):
    grid = timetable(schedule, pp, virtual, m)
    num_chunks = pp * virtual
    step_of = {}
    for r, row in enumerate(grid):
        assert len(row) == len(grid[0])
        mine = [a for a in row if a is not None]
        want = {Action(k, c, n) for k in "FB" for c in rank_chunks(r, pp, virtual) for n in range(m)}
        assert len(mine) == len(want) and set(mine) == want
        step_of.update((a, t) for t, a in enumerate(row) if a is not None)
    for (kind, c, n), t in step_of.items():
        if kind == "F" and c > 0:
            assert step_of[Action("F", c - 1, n)] < t
        if kind == "B":
            assert step_of[Action("F", c, n)] < t
            if c < num_chunks - 1:
                assert step_of[Action("B", c + 1, n)] < t
    # With equal-cost actions the grid's idle fraction is the textbook bubble.
    busy = 2 * m * virtual
    assert len(grid[0]) == busy + 2 * (pp - 1)
    assert 1 - busy / len(grid[0]) == pytest.approx(ideal_bubble(pp, m, virtual))


def test_micro_batches_alive():
    for r in range(4):
        assert peak_in_flight(rank_order("gpipe", r, 4, 1, 8)) == 8
        assert peak_in_flight(rank_order("1f1b", r, 4, 1, 8)) == 4 - r
        assert peak_in_flight(rank_order("1f1b", r, 4, 1, 2)) == min(4 - r, 2)
        # Interleaved holds more chunk-micro-batches (each is 1/v of a stage) than 1F1B ...
        assert peak_in_flight(rank_order("interleaved_1f1b", r, 4, 2, 16)) == 2 * (4 - r - 1) + 4 + 1
    # ... and its bubble is v times smaller.
    assert ideal_bubble(4, 8, 2) < ideal_bubble(4, 8, 1) == pytest.approx(3 / 11)


# ---- the stage module and the runner on one pipeline rank -----------------------------------

def reference_step(model, inputs, targets) -> float:
    """Plain gradient accumulation, as the trainer does without pipelining."""
    m = len(inputs)
    model.set_aux_loss_scale(1.0 / m)
    total = 0.0
    for x, y in zip(inputs, targets):
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        (loss / m).backward()
        total += loss.item()
    return total


def test_stages_chained_equal_the_model_and_keep_its_names():
    model = tiny_model(num_layers=5, first_k_dense=1, moe_every=2)   # MoE layers 1 and 3
    tokens, _ = token_batches(1)
    want, want_moe = model(tokens[0])
    stages = [apply_pp(copy.deepcopy(model), r, 2, 2, pp_layers=[1, 2, 1, 1]) for r in range(2)]
    assert [s.layer_ids for s in stages] == [[0, 3], [1, 2, 4]]
    assert [s.moe_indices() for s in stages] == [[1], [0]]
    x, moe = tokens[0], []
    for c in range(4):
        x, outs = stages[c % 2](x, chunk=c // 2)
        moe += outs
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    assert [o.stats.num_assignments for o in moe] == [o.stats.num_assignments for o in want_moe]
    names = [n for s in stages for n in s.state_dict()]
    assert sorted(names) == sorted(model.state_dict())    # every name once, as in the full model
    assert "layers.3.ffn.router.weight" in stages[0].state_dict()
    assert stages[0].embed is not None and stages[0].head is None and stages[1].norm is not None


def test_tied_embeddings_refused_across_ranks_but_fine_on_one():
    model = tiny_model(tie_embeddings=True)
    with pytest.raises(ValueError, match="tie_embeddings=true with parallel.pp>1"):
        apply_pp(copy.deepcopy(model), 0, 2)
    stage = apply_pp(model, 0, 1, 2)     # both ends on this rank: the tie just works
    tokens, _ = token_batches(1)
    x, _ = stage(tokens[0], chunk=0)
    logits, _ = stage(x, chunk=1)
    torch.testing.assert_close(logits, model(tokens[0])[0], rtol=0, atol=0)


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_runner_on_one_rank_equals_accumulation(schedule, virtual):
    reference = tiny_model(first_k_dense=1)
    inputs, targets = token_batches(3)
    want = reference_step(reference, inputs, targets)
    stage = apply_pp(copy.deepcopy(reference), 0, 1, virtual)
    for p in stage.parameters():
        p.grad = None
    runner = PipelineRunner(stage, 3, schedule=schedule)
    loss_sum, moe_outputs = runner.run(inputs, targets)
    assert float(loss_sum) == pytest.approx(want, rel=1e-12)
    assert [len(outs) for outs in moe_outputs] == [3, 3, 3]
    grads = dict(reference.named_parameters())
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-13, msg=name)
    order = rank_order(schedule, 0, 1, virtual, 3)
    assert [e.action for e in runner.events] == order
    assert runner.peak_in_flight == peak_in_flight(order) == {"gpipe": 3, "1f1b": 1,
                                                              "interleaved_1f1b": 2}[schedule]
