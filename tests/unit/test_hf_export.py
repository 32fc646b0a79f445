"""Export to Hugging Face: the tiny Qwen3-MoE example trains, exports and loads in transformers
through the commands its header documents; refusals name what the model has."""

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from configs import checkpoint_model, example_commands  # noqa: E402
from moepar.config import load_config  # noqa: E402
from moepar.hf import ARCHS, ConversionError, moepar_to_hf  # noqa: E402
from moepar.hf.arch import arch_problems, hf_config_dict, matching_archs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def moepar(*args):
    result = subprocess.run([sys.executable, "-m", "moepar", *args], capture_output=True,
                            text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_tiny_qwen3_example_exports_and_loads_in_transformers(tmp_path):
    """The commands in examples/tiny_qwen3.toml's header, run as written (a shorter run in a
    temporary folder); transformers' logits equal moepar's forward of the same checkpoint."""
    from moepar.layers import Transformer
    example = ROOT / "examples" / "tiny_qwen3.toml"
    run = tmp_path / "run"
    commands = example_commands(example, run, "tiny_qwen3", "step_200")
    assert [c[0] for c in commands] == ["train", "convert"]
    for words in commands:
        moepar(*words)
    checkpoint = run / "checkpoints" / "step_3"
    model = checkpoint_model(checkpoint)
    exported = json.loads((run / "hf" / "config.json").read_text())
    assert exported["model_type"] == "qwen3_moe" and exported["head_dim"] == 32
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model.eval()(ids)[0], loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    init = Transformer(model.cfg, model.router_cfg)
    assert not torch.allclose(init(ids)[0], want, atol=1e-3)   # the export is the trained model


def test_tiny_qwen3_example_fits_qwen3_only():
    cfg = load_config(str(ROOT / "examples" / "tiny_qwen3.toml"))
    assert matching_archs(cfg.model, cfg.router) == ["qwen3_moe"]


# ---- refusals: what the model has, and what the architecture needs --------------------------

TINY_PROBLEMS = {   # examples/tiny.toml: no q/k norm, layer 0 dense, softmax top-2, no renormalising
    "mixtral": ["this model has dense (non-MoE) layers [0]; mixtral needs every layer MoE",
                "this model has router.norm_topk_prob=false; mixtral needs true (it always "
                "renormalises the top-k weights)"],
    "qwen2_moe": ["this model has model.num_shared_experts=0; qwen2_moe needs shared experts (>= 1)"],
    "qwen3_moe": ["this model has model.qk_norm='none'; qwen3_moe needs 'head'"],
    "olmoe": ["this model has model.qk_norm='none'; olmoe needs 'full'",
              "this model has dense (non-MoE) layers [0]; olmoe needs every layer MoE"],
    "deepseek_v3": ["this model has model.num_shared_experts=0; deepseek_v3 needs shared experts (>= 1)",
                    "this model has model.attention='gqa'; deepseek_v3 needs 'mla'",
                    "this model has router.score_func='softmax'; deepseek_v3 needs 'sigmoid'"],
}


def _check_claims(problems, cfg):
    """Every `model.x=v` / `router.x=v` a message claims is the model's own value."""
    for line in problems:
        assert line.startswith("this model has "), line
        claims = re.findall(r"\b(model|router)\.(\w+)=('[^']*'|[\w.]+)", line.split(";")[0])
        for section, key, value in claims:
            have = getattr(getattr(cfg, section), key)
            text = (repr(have) if isinstance(have, str) else
                    str(have).lower() if isinstance(have, bool) else str(have))
            assert text == value, (line, have)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_refusals_name_what_the_model_has(arch):
    cfg = load_config(str(ROOT / "examples" / "tiny.toml"))
    problems = arch_problems(ARCHS[arch], cfg.model, cfg.router)
    assert problems == TINY_PROBLEMS[arch]
    _check_claims(problems, cfg)
    with pytest.raises(ConversionError) as info:
        hf_config_dict(ARCHS[arch], cfg.model, cfg.router)
    assert str(info.value) == (f"cannot write this model as {arch}:\n  " + "\n  ".join(problems)
                               + "\n(architectures this model fits: none)")


@pytest.mark.parametrize("overrides, arch, problems", [
    (["--model.num_shared_experts=1", "--model.qk_norm=none"], "qwen2_moe",
     ["this model has model.shared_gate=false; qwen2_moe needs true"]),
    (["--model.num_shared_experts=2", "--model.shared_gate=true"], "qwen3_moe",
     ["this model has model.num_shared_experts=2; qwen3_moe has no shared experts (needs 0)"]),
    (["--model.attention_bias=true", "--router.n_group=2", "--router.bias_update_rate=0.001"], "qwen3_moe",
     ["this model has model.attention_bias=true; qwen3_moe has no q/k/v biases (needs false)",
      "this model has router.n_group=2 (group-limited routing); qwen3_moe needs 1",
      "this model has router.bias_update_rate=0.001 (an expert selection bias); qwen3_moe has none (needs 0)"]),
    (["--model.activation=gelu", "--router.routed_scaling_factor=2.5"], "qwen3_moe",
     ["this model has model.activation='gelu'; qwen3_moe needs 'swiglu'",
      "this model has router.routed_scaling_factor=2.5; qwen3_moe needs 1.0"]),
    (["--router.type=expert_choice", "--router.capacity_factor=2"], "qwen3_moe",
     ["this model has router.type='expert_choice'; qwen3_moe needs 'topk'"]),
])
def test_other_refusals_name_what_the_model_has(overrides, arch, problems):
    cfg = load_config(str(ROOT / "examples" / "tiny_qwen3.toml"), overrides)
    got = arch_problems(ARCHS[arch], cfg.model, cfg.router)
    assert got == problems
    _check_claims(got, cfg)


def test_export_without_arch_refuses_with_every_problem_and_notes_capacity(tmp_path):
    """tiny.toml's model with per-head q/k norm: refused as mixtral (naming what it has); without
    --arch it goes out as the one it fits, qwen3_moe, with a note on its capacity factor."""
    from moepar.train import Trainer
    cfg = load_config(str(ROOT / "examples" / "tiny.toml"),
                      ["--train.steps=1", "--train.global_batch_size=4", "--train.seq_len=32",
                       f"--run.dir={tmp_path / 'run'}", "--run.tensorboard=false", "--run.log_every=0",
                       "--model.qk_norm=head"])
    Trainer(cfg, log=lambda _m: None).run()
    step = str(tmp_path / "run" / "checkpoints" / "step_1")
    with pytest.raises(ConversionError, match="cannot write this model as mixtral:\n  this model has "
                                              "model.qk_norm='head'; mixtral needs 'none'"):
        moepar_to_hf(step, str(tmp_path / "x"), "mixtral")
    notes = []
    moepar_to_hf(step, str(tmp_path / "hf"), log=notes.append)   # no --arch: the one it fits
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert notes[0] == ("note: this model has router.capacity_factor=1.25: moepar drops token "
                        "copies over an expert's capacity; transformers' qwen3_moe is dropless, "
                        "so its outputs differ wherever moepar would drop")
    # and on its per-layer balance loss, which transformers' loss over all layers cannot match
    num_moe = sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers))
    assert notes[2] == ("no tokenizer written: the model trained on bytes (data.source="
                        "'builtin'), which no Hugging Face tokenizer file says")
    assert len(notes) == 3 and notes[1].startswith(
        "note: this model has router.balance_loss='per_layer' (a Switch loss per MoE layer, "
        f"summed over {num_moe}); transformers' qwen3_moe takes one loss")


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "config.json has rope_type='dynamic'"),
    ({"partial_rotary_factor": 0.5}, "config.json has partial_rotary_factor=0.5"),
    ({"hidden_act": "gelu"}, "config.json has hidden_act='gelu'"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     "config.json has quantization_config.quant_method='awq'"),
    ({"num_attention_heads": None}, "config.json lacks 'num_attention_heads'"),
])
def test_import_refusals_name_what_config_json_has(change, message, tmp_path):
    from moepar.hf import hf_to_moepar
    from test_hf import hf_model
    _, path = hf_model("qwen3_moe", tmp_path)
    cfg = json.loads(open(f"{path}/config.json").read())
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    open(f"{path}/config.json", "w").write(json.dumps(cfg))
    with pytest.raises(ConversionError, match=re.escape(message)):
        hf_to_moepar(path, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_carries_the_tokenizer(tmp_path):
    """HF -> moepar -> HF keeps the tokenizer files (the exported tokenizer.json encodes as the
    original); a converted model without one says that no tokenizer is written."""
    from moepar.hf import hf_to_moepar
    from test_data_prepare import word_tokenizer
    from test_hf import hf_model
    _, path = hf_model("mixtral", tmp_path)
    tokenizer = pathlib.Path(word_tokenizer(tmp_path / "tok"))
    (pathlib.Path(path) / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    hf_to_moepar(path, str(tmp_path / "mp"), log=lambda _m: None)
    lines = []
    moepar_to_hf(str(tmp_path / "mp"), str(tmp_path / "back"), log=lines.append)
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert (f"tokenizer: copied tokenizer.json, generation_config.json from {tmp_path / 'mp'}"
            in lines)          # save_pretrained wrote a generation_config.json
    from tokenizers import Tokenizer
    original = Tokenizer.from_file(str(tokenizer)).encode("the cat sat").ids
    assert Tokenizer.from_file(str(tmp_path / "back" / "tokenizer.json")).encode(
        "the cat sat").ids == original
    for name in ("tokenizer.json", "generation_config.json"):   # a model with no tokenizer
        (pathlib.Path(path) / name).unlink()
    hf_to_moepar(path, str(tmp_path / "mp2"), log=lambda _m: None)
    lines.clear()
    moepar_to_hf(str(tmp_path / "mp2"), str(tmp_path / "bare"), log=lines.append)
    assert not (tmp_path / "bare" / "tokenizer.json").exists()
    assert ("no tokenizer written: there are no tokenizer files beside the checkpoint, and it "
            "records no training data") in lines


def test_export_takes_the_prepared_folders_tokenizer_only_if_it_is_the_trained_one(tmp_path):
    """A run on a prepared folder: its tokenizer.json goes beside the export when its SHA-256 is
    the one the checkpoint recorded; a folder re-prepared with another tokenizer since, or one
    that is gone, gives a note and the export still succeeds."""
    import hashlib
    from moepar.hf.convert import _export_tokenizer
    from test_data_prepare import word_tokenizer
    folder = tmp_path / "data"
    folder.mkdir()
    tok = pathlib.Path(word_tokenizer(tmp_path / "tok"))
    (folder / "tokenizer.json").write_bytes(tok.read_bytes())
    digest = hashlib.sha256(tok.read_bytes()).hexdigest()
    state = {"config": {"data": {"source": "tokens", "path": str(folder)}},
             "dataset": {"sources": [{"kind": "folder", "tokenizer_sha256": digest}]}}
    src, out = tmp_path / "ckpt", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    line = _export_tokenizer(str(src), state, str(out))
    assert line == f"tokenizer: copied tokenizer.json from the prepared folder {folder}"
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    (out / "tokenizer.json").unlink()
    (folder / "tokenizer.json").write_text("{}")          # re-prepared with another tokenizer
    line = _export_tokenizer(str(src), state, str(out))
    assert line.startswith(f"no tokenizer written: {folder / 'tokenizer.json'} is not the "
                           "tokenizer the checkpoint recorded")
    (folder / "tokenizer.json").unlink()
    assert "has no readable tokenizer.json" in _export_tokenizer(str(src), state, str(out))
    assert not (out / "tokenizer.json").exists()
