"""`moepar plan` without processes: the in-flight counts against the schedules themselves, the
search against a brute-force pass through `moepar train`'s own validation, FLOPs against the
parameter count, the pipeline term against the ideal bubble, the links' bandwidths, hardware
overrides, `--from-run`, and the written plan read back by the trainer's loader."""

import dataclasses
import json
import pathlib

import pytest

from moepar.config import load_config
from moepar.parallel.schedules import ideal_bubble, peak_in_flight, rank_order
from moepar.plan.activations import rows_per_rank
from moepar.plan.candidates import Request, config_layout, evaluate, search
from moepar.plan.flops import model_flops_per_token
from moepar.plan.footprint import in_flight
from moepar.plan.hardware import PRESETS, resolve_gpu
from moepar.layers.shapes import param_count
from moepar.plan.source import imbalance_from_run, load_model
from moepar.plan.steptime import stage_seconds, step_seconds
from moepar.plan.writer import best_runnable, plan_config, runnable, write_plan
from moepar.build import build_dims

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
H100 = PRESETS["h100-80g"]


def tiny_request(world=8, node=8, **kw):
    base = load_config(str(EXAMPLES / "tiny.toml"))
    return Request(base, world, node, 128, 16 * 128, H100, **kw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_in_flight_closed_forms_equal_the_schedules(schedule):
    checked = 0
    for pp in (2, 3, 4):
        for virtual in ((2, 3) if schedule == "interleaved_1f1b" else (1,)):
            for m in range(1, 13):
                if schedule == "interleaved_1f1b" and m % pp:
                    continue
                for r in range(pp):
                    want = peak_in_flight(rank_order(schedule, r, pp, virtual, m))
                    assert in_flight(schedule, pp, r, m, virtual) == want, (pp, virtual, m, r)
                    checked += 1
    assert checked > 50


def test_rows_per_rank():
    assert rows_per_rank(1, 2, None, 3.0) == 1.0          # one rank computes all its copies
    assert rows_per_rank(1, 2, 0.5, 3.0) == 0.5           # capacity below 1 drops copies
    assert rows_per_rank(8, 2, None, 1.7) == 1.7          # dropless: the imbalance
    assert rows_per_rank(8, 2, 1.25, 1.7) == 1.25         # capacity caps it
    assert rows_per_rank(2, 2, None, 5.0) == 2.0          # never more than everything


def test_hardware_presets_and_overrides():
    assert set(PRESETS) == {"a100-80g", "h100-80g", "h200-141g", "b200"}
    gpu = resolve_gpu("H100-80G", {"inter_gbps": "25", "compute_efficiency": "0.4"})
    assert (gpu.inter_gbps, gpu.compute_efficiency, gpu.tflops) == (25.0, 0.4, 989.0)
    assert gpu.budget_bytes == pytest.approx((79.6 - 3.0) * 0.92 * 2 ** 30)
    with pytest.raises(ValueError, match="unknown GPU field"):
        resolve_gpu("b200", {"nvlink": "1"})
    with pytest.raises(ValueError, match="is not a number"):
        resolve_gpu("b200", {"tflops": "fast"})
    with pytest.raises(ValueError, match="is not one of"):
        resolve_gpu("v100", {})
    with pytest.raises(ValueError, match="must be <= 1"):
        resolve_gpu("a100-80g", {"comm_efficiency": "1.5"})


@pytest.mark.parametrize("example", ["mixtral_8x7b.toml", "deepseek_v3.toml", "tiny.toml"])
def test_flops_per_token_are_twice_the_active_matmul_weights_plus_attention(example):
    cfg = load_config(str(EXAMPLES / example)).model
    counts = param_count(cfg)
    norms = cfg.num_layers * 2 * cfg.dim + cfg.dim            # RMSNorm weights: no matmul
    if cfg.attention == "mla":
        norms += cfg.num_layers * (cfg.q_lora_rank + cfg.kv_lora_rank)
        per_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    else:
        per_head = 2 * cfg.head_dim_resolved
    embedding = cfg.vocab_size * cfg.dim                        # a lookup, no matmul
    # causal attention: each token's scores and values over S/2 keys on average
    core = cfg.num_layers * 2 * (cfg.max_seq_len / 2) * cfg.num_heads * per_head
    want = 2 * (counts["active"] - embedding - norms) + core
    assert model_flops_per_token(cfg, cfg.max_seq_len) == pytest.approx(want, rel=1e-12)


def test_equal_stages_give_the_ideal_bubble():
    cfg = load_config(str(EXAMPLES / "mixtral_8x7b.toml"))
    from moepar.plan.activations import ActSpec
    spec = ActSpec(1, 4096, 1, 1, "bfloat16")
    stage = {"dense": 0, "moe": 8, "first": False, "last": False, "virtual": 1,
             "dense_params": 0, "expert_params": 0, "stepped": 0}
    links = {"tp": False, "ep": False, "dp": False, "edp": False, "pp": False, "ep_inside": 1.0,
             "pp_size": 4, "dp_size": 1, "edp_size": 1}
    one = stage_seconds(cfg, spec, H100, stage, links)["total"]
    for m in (4, 8, 32):
        t = step_seconds(cfg, spec, H100, [(stage, 4)], links, m, 4)
        busy = m * one
        assert 1 - busy / t["pipeline"] == pytest.approx(ideal_bubble(4, m), rel=1e-12)


def test_all_to_all_across_nodes_runs_at_network_speed():
    cfg = load_config(str(EXAMPLES / "mixtral_8x7b.toml"))
    from moepar.plan.activations import ActSpec
    spec = ActSpec(1, 4096, 1, 16, "bfloat16", row_factor=1.0)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_experts=16))
    stage = {"dense": 0, "moe": 1, "first": False, "last": False, "virtual": 1}
    links = {"tp": False, "dp": False, "edp": False, "pp": False, "pp_size": 1,
             "dp_size": 16, "edp_size": 1}
    inside = stage_seconds(cfg, spec, H100, stage, {**links, "ep": False, "ep_inside": 1.0})
    half = stage_seconds(cfg, spec, H100, stage, {**links, "ep": True, "ep_inside": 0.5})
    rows = 4096 * 2 * 4096 * 2 * 15 / 16                       # bytes each exchange sends
    net, nvlink = H100.inter_gbps * 0.7e9, H100.intra_gbps * 0.7e9
    assert inside["a2a"] == pytest.approx(4 * rows / nvlink)
    assert half["a2a"] == pytest.approx(4 * max(rows / 2 / net, rows / 2 / nvlink))


def test_search_keeps_exactly_the_layouts_train_accepts():
    """Brute force through load_config + build_dims (what `moepar train` runs) on every
    (pp, tp, ep, micro-batch) the search could try; the search's valid set must equal it."""
    req = tiny_request(world=8, node=4)
    plans, rejected = search(req)
    got = {(p.layout.pp, p.layout.tp, p.layout.ep, p.layout.micro_batch) for p in plans
           if p.layout.schedule == "1f1b"}
    want = set()
    for pp in range(1, 9):
        for tp in (1, 2, 4):
            for ep in range(1, 9):
                for mbs in range(1, 17):
                    try:
                        cfg = load_config(str(EXAMPLES / "tiny.toml"), [
                            f"--parallel.pp={pp}", f"--parallel.tp={tp}", f"--parallel.ep={ep}",
                            f"--train.micro_batch_size={mbs}", "--train.global_batch_size=16"])
                        build_dims(cfg, 8)
                    except ValueError:
                        continue
                    want.add((pp, tp, ep, mbs))
    assert got == want
    assert (1, 1, 8) not in rejected                          # 8 experts over 8 ranks fit


def test_a_family_train_refuses_is_rejected_with_trains_message():
    _, rejected = search(tiny_request(world=16, node=8))
    assert rejected[(1, 8, 1)] == {"kind": "indivisible", "value": None, "closest": None,
                                   "reason": "model.num_heads=4 must be divisible by "
                                             "parallel.tp=8 (each tp rank computes whole heads)"}


def test_every_plan_writes_a_config_that_train_loads_with_its_layout(tmp_path):
    req = tiny_request(world=4)
    plans, _ = search(req)
    fitting = [p for p in plans if p.fits]
    assert len(fitting) > 10
    best = best_runnable(plans)
    path = write_plan(str(tmp_path / "plan.toml"), req.base, best, req, "tiny")
    back = load_config(path)
    dims = build_dims(back, 4)
    lo = best.layout
    assert (dims.pp, dims.dp, dims.tp, dims.ep) == (lo.pp, lo.dp, lo.tp, lo.ep)
    assert back.parallel.zero == lo.zero and back.train.micro_batch_size == lo.micro_batch
    assert back.train.global_batch_size * back.train.seq_len == req.global_tokens
    assert back.train.activation_checkpointing == (lo.recompute == "full")
    assert "moepar train" in pathlib.Path(path).read_text().splitlines()[2]
    for p in fitting[:40]:         # every layout the table shows is one train accepts
        build_dims(plan_config(req.base, p, req), 4)


def test_every_recompute_mode_is_planned_and_written():
    req = tiny_request(world=2, recompute=("none", "full", "attention", "experts"))
    plans, _ = search(req)
    modes = {p.layout.recompute for p in plans if p.fits}
    assert modes == {"none", "full", "attention", "experts"}
    for mode in modes:      # the trainer runs each: written configs carry train.recompute
        plan = next(p for p in plans if p.fits and p.layout.recompute == mode)
        assert runnable(plan.layout)
        assert plan_config(req.base, plan, req).train.recompute == mode


def test_out_of_memory_families_say_so():
    req = tiny_request(world=2)
    req.gpu = resolve_gpu("h100-80g", {"memory_gib": "3.001", "overhead_gib": "3"})
    plans, rejected = search(req)
    assert not any(p.fits for p in plans)
    assert {r["kind"] for r in rejected.values()} == {"out of memory"}
    assert all(r["value"] > 0.001 for r in rejected.values())


@pytest.mark.parametrize("example, world", [("mixtral_8x7b.toml", 64), ("deepseek_v3.toml", 2048)])
def test_static_bytes_of_the_config_layout_equal_the_meta_device_simulation(example, world):
    from moepar.bench.simulate import simulate
    cfg = load_config(str(EXAMPLES / example))
    req = Request(cfg, world, 8, cfg.train.seq_len, cfg.train.global_batch_size * cfg.train.seq_len,
                  H100)
    layout = config_layout(req)
    plan = evaluate(req, layout)
    dims = build_dims(cfg, world)
    rank = plan.memory_rank * dims.dp * dims.tp
    got = simulate(cfg, world, [rank])["ranks"][0]
    # (the plan's parameters: the masters and, under bf16 training, the compute weights)
    assert plan.memory["params"] == got["params"] + got["compute_weights"]
    pad = got["buckets"] * max(dims.dp, dims.edp) * 4 if cfg.parallel.zero in (1, 2) else 0
    assert abs(plan.memory["grads"] - got["grads"]) <= pad
    assert abs(plan.memory["optimizer"] - got["optimizer"]) <= 2 * pad


def test_from_run_takes_the_worst_load_of_the_later_half(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ratios = [9.0, 8.0, 7.0, 1.3, 1.2, 1.6, 1.1, 1.4]     # early steps: a fresh router
    lines = [json.dumps({"step": i + 1, "max_load_ratio": r, "skipped": False})
             for i, r in enumerate(ratios)]
    lines.insert(6, '{"step": 7, "max_load_ra')        # torn by a crash
    lines.append(json.dumps({"step": 9, "max_load_ratio": 50.0, "skipped": True}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    factor, where = imbalance_from_run(str(run))
    assert factor == 1.6 and "steps 5..8" in where
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        imbalance_from_run(str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        imbalance_from_run(str(tmp_path / "nothing"))
    (run / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="no step with a max_load_ratio"):
        imbalance_from_run(str(run))


def test_bad_model_paths_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "none.toml"))
    with pytest.raises(ValueError, match="without config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(str(tmp_path / "config.json"))


@pytest.mark.parametrize("world, pp, tp, ep", [(64, 4, 2, 8), (64, 2, 1, 16), (128, 4, 4, 32),
                                               (64, 16, 2, 4), (256, 2, 8, 64)])
def test_node_spans_from_one_stage_equal_the_whole_world(world, pp, tp, ep):
    from moepar.parallel.dims import ParallelDims
    from moepar.plan.candidates import _links
    dims = ParallelDims.resolve(world, pp, 0, tp, ep, gpus_per_node=8)
    links = _links(dims)
    for axis in ("tp", "ep", "dp", "edp", "pp"):
        assert links[axis] == dims.spans_nodes(axis), axis


def test_routing_both_plans_dropless_and_capacity(tmp_path):
    req = tiny_request(world=2, routing=("dropless", "capacity"), capacity_factor=1.5)
    req = dataclasses.replace(req, base=dataclasses.replace(
        req.base, router=dataclasses.replace(req.base.router, capacity_factor=None)))
    plans, _ = search(req)
    assert {p.layout.capacity_factor for p in plans if p.fits} == {None, 1.5}
    capacity = next(p for p in plans if p.fits and p.layout.capacity_factor == 1.5)
    back = load_config(write_plan(str(tmp_path / "p.toml"), req.base, capacity, req, "tiny"))
    assert back.router.capacity_factor == 1.5
