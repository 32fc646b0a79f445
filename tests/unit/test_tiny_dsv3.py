"""examples/tiny_dsv3.toml (MLA, a shared + routed experts, group-limited sigmoid routing with the
aux-loss-free bias, one MTP depth): the commands of its header, run as written (a shorter run in
a temporary folder), train it, export it, and transformers' DeepseekV3ForCausalLM opens the export
with the logits of moepar's forward of the same checkpoint; the MTP layer is in the export."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from configs import checkpoint_model, example_commands  # noqa: E402
from moepar.cli import main as cli_main  # noqa: E402
from moepar.config import load_config  # noqa: E402
from moepar.hf.arch import matching_archs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_dsv3.toml"


def test_tiny_dsv3_is_deepseek_v3_shaped_with_mtp():
    cfg = load_config(str(EXAMPLE))
    assert matching_archs(cfg.model, cfg.router) == ["deepseek_v3"]
    m, r = cfg.model, cfg.router
    assert (m.attention, m.num_shared_experts, m.mtp_layers) == ("mla", 1, 1)
    assert (r.score_func, r.n_group, r.topk_group) == ("sigmoid", 4, 2) and r.bias_update_rate > 0


def test_tiny_dsv3_ep4_command_is_node_aligned_with_muon(tmp_path):
    """The header's 4-process command (not run here: a training subprocess already runs below)
    loads as 2 "nodes" of 2 ranks, each node holding 2 of the 4 router groups, with Muon."""
    (_, train_ep4, _) = example_commands(EXAMPLE, tmp_path, "tiny_dsv3", "step_100")
    nproc = train_ep4.index("--nproc")
    cfg = load_config(train_ep4[1], train_ep4[nproc + 2:])
    p = cfg.parallel
    assert (train_ep4[nproc + 1], p.ep, p.gpus_per_node, p.dispatcher) == ("4", 4, 2, "hierarchical")
    assert cfg.train.optimizer == "muon" and cfg.router.n_group % (p.ep // p.gpus_per_node) == 0


def test_tiny_dsv3_trains_exports_and_opens_in_transformers(tmp_path):
    run = tmp_path / "run"
    (train, train_ep4, convert) = example_commands(EXAMPLE, run, "tiny_dsv3", "step_100")
    assert (train[0], train_ep4[0], convert[0]) == ("train", "train", "convert")
    result = subprocess.run([sys.executable, "-m", "moepar", *train], capture_output=True,
                            text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert cli_main(convert) == 0     # in this process: no second interpreter to start
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mtp_loss"] > 0 for r in records) and len(records) == 3
    checkpoint = run / "checkpoints" / "step_3"
    model = checkpoint_model(checkpoint)
    exported = json.loads((run / "hf" / "config.json").read_text())
    assert exported["model_type"] == "deepseek_v3" and exported["num_nextn_predict_layers"] == 1
    hf = {}
    for file in (run / "hf").glob("*.safetensors"):
        hf.update(load_file(file))
    assert torch.equal(hf["model.layers.3.eh_proj.weight"], model.mtp[0].eh_proj.weight.detach())
    assert torch.equal(hf["model.layers.3.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model.eval()(ids)[0], loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
