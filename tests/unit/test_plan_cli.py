"""`moepar plan`'s options in-process: the table and its breakdown, --json, --explain,
--from-run, GPU field overrides, and bad input named without a traceback."""

import json

import pytest

from moepar.plan.cli import main


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table_breakdown_and_assumptions(capsys):
    rc, out, _ = run(capsys, "examples/tiny_4d.toml", "--gpus", "4", "--top", "5")
    assert rc == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    rows = lines[header + 1:header + 6]
    assert [int(r.split()[0]) for r in rows] == [1, 2, 3, 4, 5]
    steps = [float(r.split()[10]) for r in rows]
    assert steps == sorted(steps)
    assert "assumed: compute at 50% of peak" in out and "memory of #1" in out
    assert "the config's own layout (pp 2 dp 1 tp 2 ep 2 zero 1" in out


def test_json_and_overrides(capsys):
    rc, out, _ = run(capsys, "examples/tiny.toml", "--gpus", "2", "--json", "--gpu", "a100-80g",
                     "--set", "compute_efficiency=0.25", "--imbalance", "2.0")
    assert rc == 0
    report = json.loads(out)
    assert report["gpu"]["name"] == "a100-80g" and report["gpu"]["compute_efficiency"] == 0.25
    assert report["imbalance"] == 2.0 and report["evaluated"] >= report["fitting"] > 0
    best = report["plans"][0]
    assert best["memory_gib"] == pytest.approx(sum(best["memory_bytes"].values()) / 2 ** 30)


def test_explain_prints_the_rules(capsys):
    rc, out, _ = run(capsys, "examples/mixtral_8x7b.toml", "--gpus", "64", "--explain", "--top", "3")
    assert rc == 0
    for rule in ("TP inside a node", "EP over the data-parallel ranks", "PP across nodes",
                 "ZeRO when optimizer state dominates"):
        assert rule in out
    assert "46.70B parameters" in out


def test_from_run_sets_the_imbalance(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "max_load_ratio": r}) + "\n" for i, r in enumerate([5, 1.5, 1.75], 1)))
    rc, out, _ = run(capsys, "examples/tiny.toml", "--gpus", "2", "--from-run", str(tmp_path))
    assert rc == 0 and "imbalance (busiest EP rank's rows / mean): 1.75 (max_load_ratio" in out


@pytest.mark.parametrize("args, message", [
    (["missing.toml", "--gpus", "8"], "MODEL 'missing.toml' does not exist"),
    (["examples/tiny.toml", "--gpus", "12"], "--gpus 12 is not a multiple of --gpus-per-node 8"),
    (["examples/tiny.toml", "--gpus", "8", "--gpu", "v100"], "--gpu 'v100' is not one of"),
    (["examples/tiny.toml", "--gpus", "8", "--recompute", "some"], "--recompute 'some'"),
    (["examples/tiny.toml", "--gpus", "8", "--set", "tflops"], "--set 'tflops' is not FIELD=VALUE"),
    (["examples/tiny.toml", "--gpus", "8", "--from-run", "nowhere"], "is not a directory"),
    (["examples/tiny.toml", "--gpus", "8", "--imbalance", "0.5"], "--imbalance 0.5 must be >= 1"),
    (["examples/tiny.toml", "--gpus", "8", "--seq-len", "128", "--global-batch-tokens", "1000"],
     "is not a multiple of --seq-len 128"),
])
def test_bad_input_is_named(capsys, args, message):
    rc, _, err = run(capsys, *args)
    assert rc == 2 and message in err and "Traceback" not in err


def test_config_overrides_reach_the_plan(capsys):
    rc, out, _ = run(capsys, "examples/tiny.toml", "--gpus", "2", "--parallel.ep=2",
                     "--parallel.zero=2", "--top", "1")
    assert rc == 0 and "the config's own layout (pp 1 dp 2 tp 1 ep 2 zero 2" in out
    rc, _, err = run(capsys, "examples/tiny.toml", "--gpus", "2", "--model.nope=1")
    assert rc == 2 and "command line: unknown config key 'model.nope'" in err
