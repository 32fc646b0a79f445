"""`moepar inspect`: its numbers against values computed here from the load file, on hand-written
runs with known hot and dead experts and on a real training run; its errors; its plots."""

import json
import statistics

import numpy as np
import pytest

from configs import tiny_config
from moepar.inspect import main
from moepar import plots
from moepar.train import Trainer

LAYERS = [1, 3]                       # model layer numbers of the two MoE layers
NUM_EXPERTS = 6


def hand_run(run_dir, num_steps=10, first_step=1, bias=True):
    """Layer 1: expert 0 gets nothing in the last 4 steps, expert 5 the most. Layer 3: expert 2
    is hot (300 a step), experts 1 and 4 are dead throughout."""
    rng = np.random.default_rng(0)
    steps = list(range(first_step, first_step + num_steps))
    tokens = np.zeros((num_steps, 2, NUM_EXPERTS), dtype=np.int64)
    tokens[:, 0] = rng.integers(5, 40, (num_steps, NUM_EXPERTS)) + np.arange(NUM_EXPERTS) * 10
    tokens[-4:, 0, 0] = 0
    tokens[:, 1] = rng.integers(10, 30, (num_steps, NUM_EXPERTS))
    tokens[:, 1, 2] = 300
    tokens[:, 1, [1, 4]] = 0
    assigned = tokens.sum(-1)
    dropped = rng.integers(0, 20, (num_steps, 2))
    bias_SLE = np.round(rng.normal(0, 0.01, (num_steps, 2, NUM_EXPERTS)), 6)
    lines = [json.dumps({"format": "moepar.expert_load", "version": 1, "layers": LAYERS,
                         "num_experts": NUM_EXPERTS})]
    for i, step in enumerate(steps):
        record = {"step": step, "tokens": tokens[i].tolist(), "dropped": dropped[i].tolist(),
                  "assigned": assigned[i].tolist()}
        if bias:
            record["bias"] = bias_SLE[i].tolist()
        lines.append(json.dumps(record))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "expert_load.jsonl").write_text("\n".join(lines) + "\n")
    return np.array(steps), tokens.astype(float), dropped, assigned, bias_SLE if bias else None


def expected(steps, tokens_SLE, dropped_SL, assigned_SL, bias_SLE, last):
    """The report's numbers, computed the plain way (loops, statistics, polyfit)."""
    n = min(last, len(steps))
    out = []
    for row in range(tokens_SLE.shape[1]):
        window_E = tokens_SLE[-n:, row].sum(0)
        share = {e: window_E[e] / window_E.sum() for e in range(len(window_E))}
        by_share = sorted(share, key=lambda e: (-share[e], e))
        ratio = [max(t) / statistics.mean(t) for t in tokens_SLE[:, row].tolist()]
        cv = [statistics.pstdev(t) / statistics.mean(t) for t in tokens_SLE[:, row].tolist()]
        layer = {"hottest": [(e, share[e]) for e in by_share[:3]],
                 "coldest": [(e, share[e]) for e in sorted(share, key=lambda e: (share[e], e))[:3]],
                 "dead": [e for e in range(len(window_E)) if window_E[e] == 0],
                 "drop_rate": dropped_SL[-n:, row].sum() / assigned_SL[-n:, row].sum()}
        for name, series in (("max_over_mean", ratio), ("cv", cv)):
            layer[name] = (statistics.mean(series[:n]), statistics.mean(series[-n:]),
                           100 * np.polyfit(steps, series, 1)[0] if len(steps) > 1 else 0.0)
        if bias_SLE is not None:
            b = bias_SLE[-1, row].tolist()
            layer["bias"] = (min(b), b.index(min(b)), max(b), b.index(max(b)), max(b) - min(b),
                             bias_SLE[0, row].max() - bias_SLE[0, row].min())
        out.append(layer)
    return out


def inspect_json(capsys, *args):
    assert main([*map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def check_against(report, want):
    assert len(report["layers"]) == len(want)
    for got, w in zip(report["layers"], want, strict=True):
        for key in ("hottest", "coldest"):
            assert [i["expert"] for i in got[key]] == [e for e, _ in w[key]], key
            assert [i["share"] for i in got[key]] == pytest.approx([s for _, s in w[key]]), key
        assert got["dead"] == w["dead"]
        assert got["drop_rate"] == pytest.approx(w["drop_rate"])
        for name in ("max_over_mean", "cv"):
            g = got[name]
            assert (g["first"], g["last"], g["trend_per_100_steps"]) == pytest.approx(w[name])
        if "bias" in w:
            b = got["bias"]
            assert (b["min"], b["min_expert"], b["max"], b["max_expert"], b["range"],
                    b["first_range"]) == pytest.approx(w["bias"])
        else:
            assert got["bias"] is None


@pytest.mark.parametrize("last", [4, 5, 10, 50])
def test_report_numbers_on_known_hot_and_dead_experts(tmp_path, capsys, last):
    data = hand_run(tmp_path)
    report = inspect_json(capsys, tmp_path, "--last", last)
    assert [layer["layer"] for layer in report["layers"]] == LAYERS
    assert report["window"] == {"steps": min(last, 10), "first_step": 11 - min(last, 10),
                                "last_step": 10}
    check_against(report, expected(*data, last))
    layer1, layer3 = report["layers"]
    assert layer1["dead"] == ([0] if last == 4 else [])      # idle only in the last 4 steps
    assert layer3["dead"] == [1, 4] and layer3["hottest"][0]["expert"] == 2
    assert layer1["hottest"][0]["expert"] == 5


def test_text_report_names_model_layers_and_hand_shares(tmp_path, capsys):
    steps, tokens, *_ = hand_run(tmp_path)
    assert main([str(tmp_path), "--last", "4"]) == 0
    text = capsys.readouterr().out
    assert "layer 1\n" in text and "layer 3\n" in text and "layer 0" not in text
    share = tokens[-4:, 1, 2].sum() / tokens[-4:, 1].sum()
    assert f"e2 {100 * share:.1f}%" in text
    assert "dead       2: e1, e4" in text and "dead       1: e0" in text


def test_step_tokens_and_unrecorded_step(tmp_path, capsys):
    steps, tokens, *_ = hand_run(tmp_path, first_step=5)
    report = inspect_json(capsys, tmp_path, "--step", 7)
    assert [layer["step_tokens"] for layer in report["layers"]] == tokens[2].tolist()
    assert main([str(tmp_path), "--step", "3"]) == 1
    assert "step 3 is not recorded" in capsys.readouterr().err


def test_compare_puts_two_runs_side_by_side(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    data_a, data_b = hand_run(a), hand_run(b, num_steps=7, bias=False)
    report = inspect_json(capsys, a, "--compare", b, "--last", 5)
    assert [r["run"] for r in report["runs"]] == [str(a), str(b)]
    check_against(report["runs"][0], expected(*data_a, 5))
    check_against(report["runs"][1], expected(*data_b, 5))
    assert main([str(a), "--compare", str(b)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("layer 3"))
    assert header.split() == ["layer", "3", str(a), str(b)]
    assert "not learned" in text


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


HEADER = json.dumps({"format": "moepar.expert_load", "version": 1, "layers": [1],
                     "num_experts": 2})
STEP = '{"step": %d, "tokens": [[3, 1]], "dropped": [0], "assigned": [4]}'


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "does not exist"),
    (lambda d: write(d, "x"), "is not a directory"),
    (lambda d: write(d / "notes.txt", "x"), "is not a moepar run directory"),
    (lambda d: write(d / "config.toml", ""), "is a moepar run without expert_load.jsonl"),
    (lambda d: write(d / "expert_load.jsonl", ""), "is empty"),
    (lambda d: write(d / "expert_load.jsonl", HEADER + "\n"), "has no recorded steps yet"),
    (lambda d: write(d / "expert_load.jsonl", '{"step": 1}\n'),
     "expert_load.jsonl:1: not a moepar"),
    (lambda d: write(d / "expert_load.jsonl", HEADER.replace('[1]', '[]') + "\n"),
     "the model has no MoE layers"),
    (lambda d: write(d / "expert_load.jsonl", "\n".join([HEADER, STEP % 1, '{"step": 2, "tok',
                                                         STEP % 3]) + "\n"),
     r"expert_load.jsonl:3 is not valid JSON \(Unterminated string"),
    (lambda d: write(d / "expert_load.jsonl", "\n".join([HEADER, STEP % 1, STEP % 1]) + "\n"),
     "expert_load.jsonl:3: step 1 after step 1"),
    (lambda d: write(d / "expert_load.jsonl", "\n".join(
        [HEADER, STEP % 1, STEP.replace("[[3, 1]]", "[[3, 1, 0]]") % 2, STEP % 3]) + "\n"),
     r"expert_load.jsonl:3: 'tokens' has shape \[1, 3\], expected \[1, 2\]"),
])
def test_clear_errors(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    assert main([str(run)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moepar inspect: ") and "Traceback" not in err
    assert __import__("re").search(message, err), err


def test_torn_last_line_is_left_out_and_reported(tmp_path, capsys):
    write(tmp_path / "expert_load.jsonl", "\n".join([HEADER, STEP % 1, STEP % 2, STEP[:30]]))
    report = inspect_json(capsys, tmp_path)
    assert report["torn_line"] == 4 and report["last_step"] == 2
    assert main([str(tmp_path)]) == 0
    assert "the last line (4) of its expert_load.jsonl is torn" in capsys.readouterr().out


def luminance(rgb):
    return rgb[..., :3].astype(float) @ np.array([0.2126, 0.7152, 0.0722])


def test_heatmap_pixel_colours_order_like_the_loads(tmp_path):
    ratio_LE = np.array([[0.0, 0.5, 1.0, 1.5, 2.5], [3.0, 0.2, 0.9, 1.1, 0.0]])
    fig = plots.heatmap_figure([("", ratio_LE, [4, 7])], "title")
    path = plots.save(fig, str(tmp_path / "h.png"))
    from PIL import Image
    image = np.asarray(Image.open(path).convert("RGB"))
    ax = fig.axes[0]
    height = image.shape[0]
    centres = [ax.transData.transform((e, l)) for l in range(2) for e in range(5)]
    lum = [luminance(image[int(round(height - y)), int(round(x))]) for x, y in centres]
    loads = ratio_LE.ravel()
    # darker is fewer tokens: the colours sort the cells exactly as the loads do
    assert np.argsort(lum, kind="stable").tolist() == np.argsort(loads, kind="stable").tolist()
    assert lum[0] == pytest.approx(lum[9])     # two idle cells, one colour
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["4", "7"] and ax.get_xlabel() == "expert"
    assert ax.get_ylabel() == "model layer" and len(fig.axes) == 2   # + the colour bar


def png_size(path):
    from PIL import Image
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG"
        return image.size


def test_plots_are_pngs_of_the_documented_sizes(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    hand_run(a)
    hand_run(b)
    assert main([str(a), "--plots", str(tmp_path / "one"), "--step", "6"]) == 0
    # heatmap: 2 layers x 6 experts -> (max(5, 2 + 1.5) + 1.25) x max(3, 1.5 + 0.5) inches at
    # 100 dpi; imbalance: 7 + 1.25 by 4; tokens: 2 panels of 3.25 + 0.5 by 2.5 + 0.75
    sizes = {"heatmap.png": (625, 300), "imbalance.png": (825, 400),
             "tokens_step_6.png": (700, 325)}
    for name, size in sizes.items():
        assert png_size(tmp_path / "one" / name) == size, name
    assert main([str(a), "--compare", str(b), "--plots", str(tmp_path / "two")]) == 0
    sizes = {"heatmap.png": (1125, 300), "imbalance.png": (1525, 400),
             "tokens_step_10.png": (700, 325)}
    for name, size in sizes.items():
        assert png_size(tmp_path / "two" / name) == size, name
    assert f"wrote {tmp_path / 'two' / 'heatmap.png'}" in capsys.readouterr().out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real 6-step run: MoE layers 1 and 2 of a 3-layer model, drops, a learned bias."""
    run = tmp_path_factory.mktemp("trained")
    cfg = tiny_config(run, "--model.num_layers=3", "--model.first_k_dense=1",
                      "--router.capacity_factor=1.0", "--router.bias_update_rate=0.01")
    Trainer(cfg, log=lambda _m: None).run()
    return run


def test_report_of_a_real_run_matches_its_load_file(trained, capsys):
    header, *records = [json.loads(line) for line in
                        (trained / "expert_load.jsonl").read_text().splitlines()]
    data = (np.array([r["step"] for r in records]),
            np.array([r["tokens"] for r in records], dtype=float),
            np.array([r["dropped"] for r in records], dtype=float),
            np.array([r["assigned"] for r in records], dtype=float),
            np.array([r["bias"] for r in records], dtype=float))
    report = inspect_json(capsys, trained, "--last", 3)
    assert report["moe_layers"] == [1, 2] and report["num_steps"] == 6
    check_against(report, expected(*data, 3))


def test_plots_of_a_real_run(trained, tmp_path, capsys):
    assert main([str(trained), "--plots", str(tmp_path)]) == 0
    assert png_size(tmp_path / "heatmap.png") == (625, 300)      # 2 layers x 4 experts
    assert png_size(tmp_path / "tokens_step_6.png") == (700, 325)
    assert png_size(tmp_path / "imbalance.png") == (825, 400)
