"""Every example config trains for a few steps through the real CLI, and bad input fails cleanly."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


def moepar(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moepar", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=240)


def errors(result) -> str:
    """stderr's tail without the launcher's and torch's warning chatter (the real error stays)."""
    noise = ("torch/distributed/run.py", "*****", "OMP_NUM_THREADS", "Warning", "return func")
    lines = [l for l in result.stderr.splitlines() if not any(n in l for n in noise)]
    return "\n".join(lines)[-3000:]


def test_there_are_examples():
    assert EXAMPLES


def nproc_of(example: pathlib.Path) -> list[str]:
    """An example that needs several processes says so in its first usage line: `--nproc N`
    (a later line may show another layout with its own overrides, e.g. tiny_dsv3's ep4 run)."""
    first = re.search(r"^#\s+moepar train .*$", example.read_text(), flags=re.M)
    found = first and re.search(r"--nproc (\d+)", first.group(0))
    return ["--nproc", found.group(1)] if found else []


def simulate_only(example: pathlib.Path) -> bool:
    """Configs too large for a CPU say so; tests/unit/test_simulate.py builds them on meta."""
    return "moepar: simulate-only" in example.read_text()


@pytest.mark.parametrize("example", [e for e in EXAMPLES if not simulate_only(e)],
                         ids=lambda p: p.name)
def test_example_trains(example, tmp_path):
    result = moepar("train", str(example), *nproc_of(example), "--train.steps=3",
                    "--train.warmup_steps=1", "--run.log_every=1", f"--run.dir={tmp_path}")
    assert result.returncode == 0, errors(result)
    assert "step     3/3" in result.stdout
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "step_3" / "manifest.json").exists()


def test_four_axis_example_matches_the_single_process_losses(tmp_path):
    """tiny_4d.toml (pp 2 x tp 2, ep 2, ZeRO-1 on 4 processes) is tiny.toml in another layout."""
    runs = {}
    for name, extra in (("tiny.toml", []), ("tiny_4d.toml", ["--nproc", "4"])):
        run_dir = tmp_path / name
        result = moepar("train", str(ROOT / "examples" / name), *extra, "--train.steps=2",
                        "--run.log_every=1", f"--run.dir={run_dir}")
        assert result.returncode == 0, errors(result)
        runs[name] = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for one, four in zip(runs["tiny.toml"], runs["tiny_4d.toml"]):
        for key in ("loss", "grad_norm", "aux_loss", "drop_fraction"):
            assert abs(one[key] - four[key]) <= 1e-4 * abs(one[key]) + 1e-6, (key, one, four)


def test_config_error_names_the_key(tmp_path):
    result = moepar("train", str(ROOT / "examples" / "tiny.toml"), "--model.dimm=3",
                    f"--run.dir={tmp_path}")
    assert result.returncode == 2
    assert "model.dimm" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bench_moe_layer_json():
    result = moepar("bench", "moe-layer", "--tokens=256", "--dim=32", "--ffn-dim=64",
                    "--experts=4", "--repeats=1", "--warmup=0", "--json")
    assert result.returncode == 0, errors(result)
    record = json.loads(result.stdout)
    for key in ("moe_ms", "ideal_ms", "naive_ms", "ratio_vs_ideal"):
        assert record[key] > 0


def test_bench_moe_layer_ep_parts_the_exposed_all_to_all_time():
    """--ep 2 with 2 chunks reports the split of the exposed all-to-all time (its arithmetic is
    tests/unit/test_a2a_timer.py); the time on the wire lies inside the time in flight."""
    result = moepar("bench", "moe-layer", "--ep=2", "--tokens=256", "--dim=32", "--ffn-dim=64",
                    "--experts=4", "--a2a-chunks=2", "--repeats=3", "--warmup=1", "--json")
    assert result.returncode == 0, errors(result)
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["a2a_chunks"] == 2
    for key in ("total", "exposed", "peer_wait", "comm", "on_wire"):
        assert record[f"a2a_{key}_ms"] >= 0
    assert 0 < record["a2a_on_wire_ms"] <= record["a2a_total_ms"] + 1e-6
    assert 0 < record["a2a_comm_share"]


def test_nproc_launcher_trains_with_expert_parallelism(tmp_path):
    """The README's multi-process command: torch's launcher, 2 workers, ep=2, same first loss."""
    single = moepar("train", str(ROOT / "examples" / "tiny.toml"), "--train.steps=2",
                    "--run.log_every=1", f"--run.dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-3000:]
    result = moepar("train", str(ROOT / "examples" / "tiny.toml"), "--nproc", "2",
                    "--parallel.ep=2", "--train.steps=2", "--run.log_every=1",
                    f"--run.dir={tmp_path / 'two'}")
    assert result.returncode == 0, errors(result)
    assert "ep 2" in result.stdout
    one = [json.loads(l) for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(l) for l in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    # float32 sums in another order: equal to float32 precision, not bit for bit
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * a["loss"], (a["loss"], b["loss"])
    index = json.loads((tmp_path / "two" / "checkpoints" / "step_2" / "index.json").read_text())
    files = {piece["file"] for entry in index["model"].values() for piece in entry["pieces"]}
    assert files == {"model-r00000.safetensors", "model-r00001.safetensors"}


def test_bad_layout_fails_before_launching(tmp_path):
    result = moepar("train", str(ROOT / "examples" / "tiny.toml"), "--nproc", "3",
                    "--parallel.ep=2", f"--run.dir={tmp_path}")
    assert result.returncode == 2
    assert "parallel.ep=2" in result.stderr and "dp * parallel.tp" in result.stderr


def test_bench_dispatch_json():
    result = moepar("bench", "dispatch", "--ep=2", "--tokens=64", "--dim=16", "--experts=4",
                    "--repeats=1", "--warmup=0", "--json")
    assert result.returncode == 0, errors(result)
    record = json.loads(result.stdout.strip().splitlines()[-1])
    cases = record["cases"]
    assert set(cases) == {"alltoall", "dedup", "allgather"}
    # every kept copy crosses once each way at most, dedup never sends more hidden bytes
    assert cases["dedup"]["bytes_per_token_hidden"] <= cases["alltoall"]["bytes_per_token_hidden"]


def test_bench_memory_json():
    """`moepar bench memory --zero 2 --dp 2 --ep 2`: two workers, each within 5% of the formula."""
    result = moepar("bench", "memory", "--zero=2", "--dp=2", "--ep=2", "--dim=32", "--layers=2",
                    "--heads=4", "--experts=4", "--json")
    assert result.returncode == 0, errors(result)
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert (record["zero"], record["dp"], record["ep"], len(record["ranks"])) == (2, 2, 2, 2)
    for rank in record["ranks"]:
        for part in ("params", "grads", "optimizer"):
            assert abs(rank["measured"][part] / rank["formula"][part] - 1) < 0.05, rank


def test_bench_pipeline_json_activation_memory_follows_the_schedule():
    """GPipe keeps all 8 micro-batches' activations; 1F1B at most pp (stage 0: 2, stage 1: 1)."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        result = moepar("bench", "pipeline", "--pp=2", f"--schedule={schedule}", "--dim=32",
                        "--layers=2", "--heads=4", "--experts=4", "--seq=32", "--repeats=1",
                        "--warmup=0", "--microbatches=8", "--json")
        assert result.returncode == 0, errors(result)
        record = json.loads(result.stdout.strip().splitlines()[-1])
        assert record["ideal_bubble"] == 1 / 9
        ranks = sorted(record["ranks"], key=lambda r: r["pp_rank"])
        assert all(0 <= r["bubble"] < 1 for r in ranks)
        peaks[schedule] = [(r["peak_in_flight"], r["peak_activation_bytes"]) for r in ranks]
    assert [n for n, _ in peaks["gpipe"]] == [8, 8] and [n for n, _ in peaks["1f1b"]] == [2, 1]
    for stage, (gpipe, one_f_one_b) in enumerate(zip(peaks["gpipe"], peaks["1f1b"])):
        # measured bytes scale with the micro-batches in flight (8/2 and 8/1), within 15%
        ratio = gpipe[1] / one_f_one_b[1]
        assert abs(ratio / (gpipe[0] / one_f_one_b[0]) - 1) < 0.15, (stage, ratio)


def test_under_torchrun(tmp_path):
    """`torchrun --nproc_per_node 2 -m moepar train ...`: moepar joins the launcher's world."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "moepar", "train", str(ROOT / "examples" / "tiny.toml"), "--parallel.ep=2",
         "--train.steps=2", "--run.log_every=1", f"--run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, errors(result)
    assert result.stdout.count("step     2/2") == 1          # rank 0 alone reports
    assert "world 2 = pp 1 x dp 2 x tp 1; experts: pp 1 x edp 1 x ep 2" in result.stdout


def test_hf_convert_train_export_through_the_cli(tmp_path):
    """The README's conversion flow with the real commands: HF -> moepar -> moepar train -> HF."""
    transformers = pytest.importorskip("transformers")
    import numpy as np

    from configs import tiny_mixtral
    tiny_mixtral(tmp_path / "hf", initializer_range=0.1)
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 64, 4000).astype(np.uint16))
    steps = [
        ("convert", "--from", "hf", str(tmp_path / "hf"), "--to", "moepar", str(tmp_path / "mp")),
        ("train", str(tmp_path / "mp" / "config.toml"), f"--run.init_from={tmp_path / 'mp'}",
         "--data.source=tokens", f"--data.path={tmp_path / 'tokens.npy'}", "--train.steps=3",
         "--train.seq_len=16", "--train.warmup_steps=1", f"--run.dir={tmp_path / 'run'}"),
        ("convert", "--from", "moepar", str(tmp_path / "run" / "checkpoints" / "step_3"),
         "--to", "hf", str(tmp_path / "back")),
    ]
    for args in steps:
        result = moepar(*args)
        assert result.returncode == 0, (args[0], result.stderr[-3000:])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 4


def test_simulate_only_examples_are_simulated():
    tested = pathlib.Path(__file__).resolve().parents[1] / "unit" / "test_simulate.py"
    for example in filter(simulate_only, EXAMPLES):
        assert example.name in tested.read_text(), example.name


def test_bench_memory_simulate_json():
    result = moepar("bench", "memory", "--simulate", "--world", "64", "--config",
                    str(ROOT / "examples" / "mixtral_8x7b.toml"), "--ranks", "0", "--json")
    assert result.returncode == 0, errors(result)
    record = json.loads(result.stdout)
    assert record["ranks"][0]["rank"] == 0 and record["total_params"] > 46e9


def test_bench_train_json():
    result = moepar("bench", "train", "--config", str(ROOT / "examples" / "tiny.toml"),
                    "--steps", "1", "--warmup", "0", "--device", "cpu", "--json")
    assert result.returncode == 0, errors(result)
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["tokens_per_step"] == 16 * 128 and record["mfu"] is None
    assert record["tokens_per_s"] == pytest.approx(record["tokens_per_step"] / record["step_ms"] * 1e3)
