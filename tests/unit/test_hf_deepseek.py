"""Real DeepSeek-V3 checkpoints: YaRN rope scaling against transformers (tables, softmax scale,
logits past the original context), FP8 block-quantized weights against a dequantization done here
block by block, and the multi-token-prediction layer kept (model.mtp_layers), dequantized too."""

import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from test_hf import hf_model  # noqa: E402
from moepar.hf import ConversionError, from_hf, hf_to_moepar, moepar_to_hf  # noqa: E402
from moepar.hf.arch import read_hf_config  # noqa: E402
from moepar.hf.fp8 import dequantized  # noqa: E402

DEEPSEEK_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
SKEWED_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
               "beta_fast": 8, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0}
WIDE_ROPE = dict(qk_rope_head_dim=16, qk_nope_head_dim=8)   # 8 frequencies, not 2: a real ramp


# ---- YaRN -----------------------------------------------------------------------------------

@pytest.mark.parametrize("config_cls, fields, rope", [
    ("DeepseekV3Config", dict(max_position_embeddings=163840, qk_rope_head_dim=64),   # V3's own
     {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ("Qwen3MoeConfig", dict(max_position_embeddings=131072, head_dim=128, rope_theta=1e6),
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("DeepseekV3Config", dict(max_position_embeddings=8192, qk_rope_head_dim=64),
     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "mscale": 0.707}),
    ("DeepseekV3Config", dict(max_position_embeddings=8192, qk_rope_head_dim=32),
     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
      "beta_slow": 2, "attention_factor": 1.2, "truncate": False}),
])
def test_yarn_frequencies_and_scale_equal_transformers(config_cls, fields, rope, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = getattr(transformers, config_cls)(rope_scaling=dict(rope), **fields)
    want_inv_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    config.save_pretrained(tmp_path)
    _, model_cfg, _ = read_hf_config(str(tmp_path))
    yarn = model_cfg.yarn
    got = yarn.inv_freq(model_cfg.rope_dim, model_cfg.rope_theta)
    torch.testing.assert_close(got.float(), want_inv_freq, rtol=2e-7, atol=0)   # HF: float32
    assert math.isclose(yarn.cos_sin_scale, want_scale, rel_tol=1e-12)


def _forget_hf_config(checkpoint):
    """Drops hf_config.json, so export writes a config.json from moepar's own fields."""
    os.remove(checkpoint / "hf_config.json")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"]["hf_config.json"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("arch, rope", [("deepseek_v3", DEEPSEEK_YARN), ("deepseek_v3", SKEWED_YARN),
                                        ("qwen3_moe", SKEWED_YARN)])
def test_yarn_logits_equal_transformers_past_the_original_context(arch, rope, tmp_path):
    """48 positions, three times the original 16; the softmax scale is transformers' too. A model
    exported from moepar's own fields (no hf_config.json) loads in transformers with the same
    logits."""
    wide = WIDE_ROPE if arch == "deepseek_v3" else {}
    model, path = hf_model(arch, tmp_path, rope_scaling=dict(rope), **wide)
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        ours = from_hf(path)
        torch.testing.assert_close(ours(ids), want, rtol=1e-5, atol=1e-5)
    if arch == "deepseek_v3":
        assert ours.model.layers[0].attn.softmax_scale == pytest.approx(
            model.model.layers[0].self_attn.scaling, rel=1e-12)
        assert model.model.layers[0].self_attn.scaling != pytest.approx((8 + 16) ** -0.5)
    hf_to_moepar(path, str(tmp_path / "mp"))
    _forget_hf_config(tmp_path / "mp")
    moepar_to_hf(str(tmp_path / "mp"), str(tmp_path / "back"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-5, atol=1e-5)


# ---- FP8 --------------------------------------------------------------------------------------

BLOCK = [16, 8]   # kv_b_proj [56, 12] and the experts' [24, 32] end in partial blocks


def _quantizable(name, tensor):
    """What DeepSeek-V3 stores in FP8: every projection matrix (not embeddings, head, norms,
    router)."""
    return tensor.dim() == 2 and name.endswith("_proj.weight")


def _quantize(w, block):
    """e4m3 per block with scale amax/448, written out block by block."""
    (bm, bn), (rows, cols) = block, w.shape
    scale = torch.empty(-(-rows // bm), -(-cols // bn))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            scale[i, j] = part.abs().max() / 448
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _reference_dequantize(q, scale, block, dtype):
    """The value an FP8 weight stands for, one block at a time (independent of moepar.hf.fp8)."""
    bm, bn = block
    out = torch.empty(q.shape, dtype=dtype)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].to(torch.float32) * scale[i, j]
            out[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = part.to(dtype)
    return out


def _add_mtp_layer(tensors, num_layers):
    """DeepSeek-V3's MTP layer as it is stored: a copy of a decoder layer at index num_layers plus
    its norms and projection, and copies of the main embedding and head."""
    mtp = {name.replace(f"layers.{num_layers - 1}.", f"layers.{num_layers}."): t.clone()
           for name, t in tensors.items() if name.startswith(f"model.layers.{num_layers - 1}.")}
    dim, vocab = tensors["model.norm.weight"].shape[0], tensors["model.embed_tokens.weight"].shape[0]
    pre = f"model.layers.{num_layers}."
    mtp.update({pre + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                pre + "enorm.weight": torch.ones(dim), pre + "hnorm.weight": torch.ones(dim),
                pre + "eh_proj.weight": torch.randn(dim, 2 * dim),
                pre + "shared_head.norm.weight": torch.ones(dim),
                pre + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    return mtp


def _write_folder(folder, config, tensors, shards=1):
    """A HF folder; with shards > 1, names dealt round-robin (a weight and its scale apart)."""
    os.makedirs(folder)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, folder / "model.safetensors")
        return
    weight_map = {}
    for s in range(shards):
        file = f"model-{s:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in names[s::shards]}, folder / file)
        weight_map.update({k: file for k in names[s::shards]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _moepar_tensors(checkpoint):
    index = json.loads((checkpoint / "index.json").read_text())["model"]
    out = {}
    for file in set(index.values()):
        out.update(load_file(checkpoint / file))
    return out


def _published_v3(tmp_path, dtype):
    """A tiny DeepSeek-V3 laid out as the published one: YaRN, FP8 weights with their
    `_scale_inv` in 16x8 blocks, an MTP layer (FP8 too), sharded. Returns (its folder, a plain
    folder holding the weights it stands for, the number of MTP tensors stored)."""
    _, path = hf_model("deepseek_v3", tmp_path, rope_scaling=dict(DEEPSEEK_YARN), **WIDE_ROPE)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    tensors = load_file(os.path.join(path, "model.safetensors"))
    mtp = _add_mtp_layer(tensors, config["num_hidden_layers"])
    fp8, plain = {}, {}
    for name, t in {**tensors, **mtp}.items():
        if _quantizable(name, t):
            q, scale = _quantize(t, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            plain[name] = _reference_dequantize(q, scale, BLOCK, dtype)
        else:
            fp8[name], plain[name] = t, t
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "weight_block_size": BLOCK}
    _write_folder(tmp_path / "fp8", dict(config, quantization_config=quant, num_nextn_predict_layers=1),
                  fp8, shards=3)
    _write_folder(tmp_path / "plain", dict(config, num_nextn_predict_layers=1), plain)
    return tmp_path / "fp8", tmp_path / "plain", len([n for n in fp8 if ".layers.3." in n])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_checkpoint_dequantizes_to_the_block_by_block_reference(dtype, tmp_path):
    fp8, plain, _ = _published_v3(tmp_path, dtype)
    notes = []
    hf_to_moepar(str(fp8), str(tmp_path / "from_fp8"), dequantize_dtype=dtype, log=notes.append)
    hf_to_moepar(str(plain), str(tmp_path / "from_plain"), log=notes.append)
    got, want = _moepar_tensors(tmp_path / "from_fp8"), _moepar_tensors(tmp_path / "from_plain")
    assert set(got) == set(want)      # nothing else dropped, nothing extra
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert got["layers.1.ffn.experts.3.w_in"].dtype == dtype
    assert got["mtp.0.block.ffn.experts.3.w_in"].dtype == dtype      # the MTP layer is kept
    assert notes == []
    state = json.loads((tmp_path / "from_fp8" / "state.json").read_text())
    assert state["import_notes"] == [f"dequantized FP8 weights to {str(dtype)[6:]}"]
    assert state["config"]["model"]["mtp_layers"] == 1
    exported = json.loads((tmp_path / "from_fp8" / "hf_config.json").read_text())
    assert "quantization_config" not in exported and exported["num_nextn_predict_layers"] == 1


def test_fp8_checkpoint_logits_equal_transformers_on_the_dequantized_weights(tmp_path):
    fp8, plain, _ = _published_v3(tmp_path, torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(plain).eval()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(5))
    notes = []
    with torch.no_grad():
        torch.testing.assert_close(from_hf(str(fp8), log=notes.append)(ids), reference(ids).logits,
                                   rtol=1e-5, atol=1e-5)
    assert notes == []


def test_dequantize_streams_one_weight_at_a_time():
    """Each weight comes out as soon as its scale has arrived: the stream never holds more."""
    consumed = []
    weights = [torch.randn(20, 12) for _ in range(4)]

    def source():
        for i, w in enumerate(weights):
            q, scale = _quantize(w, BLOCK)
            consumed.append(i)
            yield f"w{i}", q
            consumed.append(i)
            yield f"w{i}_scale_inv", scale
    for k, (name, tensor) in enumerate(dequantized(source(), tuple(BLOCK), torch.float32)):
        assert name == f"w{k}" and len(consumed) == 2 * (k + 1)
        torch.testing.assert_close(tensor, weights[k], rtol=0.07, atol=1e-6)   # e4m3: 3 mantissa bits


def test_dequantize_stacked_experts_and_big_blocks():
    """Leading dims (experts stacked as [E, M, N], as transformers stores gate_up_proj) and
    DeepSeek's 128x128 blocks with partial ones at the end (kv_a_proj_with_mqa-like 576 rows);
    several chunks of block rows (over 4M weights)."""
    from moepar.hf.fp8 import dequantize
    torch.manual_seed(0)
    w = torch.randn(3, 200, 300)
    parts = [_quantize(w[e], (128, 128)) for e in range(3)]
    q, scale = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    want = torch.stack([_reference_dequantize(*p, (128, 128), torch.float32) for p in parts])
    assert torch.equal(dequantize("x", q, scale, (128, 128), torch.float32), want)
    q, scale = _quantize(torch.randn(576, 7300), (128, 128))
    assert torch.equal(dequantize("y", q, scale, (128, 128), torch.bfloat16),
                       _reference_dequantize(q, scale, (128, 128), torch.bfloat16))


@pytest.mark.parametrize("damage, message", [
    ("no_scale", "FP8 tensor(s) without their _scale_inv: ['model.layers.0.self_attn.o_proj.weight']"),
    ("bad_scale", "model.layers.0.self_attn.o_proj.weight_scale_inv has shape (1, 1); a weight of "
                  "shape (32, 24) in 16x8 blocks needs (2, 3)"),
    ("no_config", "tensor 'model.layers.0.self_attn.o_proj.weight' is torch.float8_e4m3fn but "
                  "config.json has no quantization_config"),
    ("layer_4", "unexpected tensor 'model.layers.4.enorm.weight'"),
])
def test_bad_fp8_or_extra_layers_named(damage, message, tmp_path):
    _, path = hf_model("deepseek_v3", tmp_path)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    q, scale = _quantize(tensors[name], BLOCK)
    tensors[name] = q
    if damage != "no_scale":
        tensors[name + "_scale_inv"] = scale[:1, :1] if damage == "bad_scale" else scale
    if damage == "layer_4":    # num_nextn_predict_layers=1 drops layer 3, not 4
        tensors["model.layers.4.enorm.weight"] = torch.ones(32)
    if damage != "no_config":
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": BLOCK}
    _write_folder(tmp_path / "bad", config, tensors)
    with pytest.raises(ConversionError, match=re.escape(message)):
        hf_to_moepar(str(tmp_path / "bad"), str(tmp_path / "out"), log=lambda _m: None)
    assert not (tmp_path / "out").exists()


def test_convert_cli_dequantizes_to_the_dtype_asked_and_prints_the_note(tmp_path, capsys):
    from moepar.hf.cli import main
    fp8, _, _ = _published_v3(tmp_path, torch.float32)
    assert main(["--from", "hf", str(fp8), "--to", "moepar", str(tmp_path / "out"),
                 "--dequantize-dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "multi-token-prediction" not in out and "wrote " in out
    out_tensors = _moepar_tensors(tmp_path / "out")
    assert out_tensors["layers.0.attn.o_proj.weight"].dtype == torch.float32
    assert out_tensors["mtp.0.eh_proj.weight"].dtype == torch.float32


# ---- multi-token prediction -------------------------------------------------------------------

def _v3_with_mtp(tmp_path, damage=None):
    """A tiny DeepSeek-V3 with its MTP layer (layer 3, after 3 decoder layers), as published:
    num_nextn_predict_layers=1, the copies of the embedding and head beside it; bfloat16."""
    _, path = hf_model("deepseek_v3", tmp_path, **WIDE_ROPE)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    assert config["num_hidden_layers"] == 3
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors.update(_add_mtp_layer(tensors, 3))
    gen = torch.Generator().manual_seed(7)
    tensors = {k: (v + 0.1 * torch.randn(v.shape, generator=gen) if "norm" in k else v)
               .to(torch.bfloat16) for k, v in tensors.items()}   # norms not all ones
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    if damage:
        tensors[damage] = tensors[damage].clone()
        tensors[damage][0, 0] += 1
    config = dict(config, num_nextn_predict_layers=1, torch_dtype="bfloat16")
    config.pop("num_mtp_layers", None)
    _write_folder(tmp_path / "v3", config, tensors, shards=2)
    return tmp_path / "v3", tensors


def test_mtp_layer_round_trip_hf_moepar_hf_is_bit_for_bit(tmp_path):
    src, tensors = _v3_with_mtp(tmp_path)
    hf_to_moepar(str(src), str(tmp_path / "mp"), log=lambda _m: None)
    got = _moepar_tensors(tmp_path / "mp")
    assert torch.equal(got["mtp.0.eh_proj.weight"], tensors["model.layers.3.eh_proj.weight"])
    assert torch.equal(got["mtp.0.norm.weight"], tensors["model.layers.3.shared_head.norm.weight"])
    assert torch.equal(got["mtp.0.block.ffn.router.weight"],
                       tensors["model.layers.3.mlp.gate.weight"])
    assert not any("embed_tokens" in n or "shared_head" in n for n in got)   # shared, not copied
    moepar_to_hf(str(tmp_path / "mp"), str(tmp_path / "back"), log=lambda _m: None)
    back = {}
    for file in os.listdir(tmp_path / "back"):
        if file.endswith(".safetensors"):
            back.update(load_file(tmp_path / "back" / file))
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert (json.loads((tmp_path / "back" / "config.json").read_text())
            == json.loads((src / "config.json").read_text()))


@pytest.mark.parametrize("copy", ["model.layers.3.embed_tokens.weight",
                                  "model.layers.3.shared_head.head.weight"])
def test_mtp_copy_of_a_shared_tensor_that_differs_is_refused(tmp_path, copy):
    src, _ = _v3_with_mtp(tmp_path, damage=copy)
    with pytest.raises(ConversionError, match=re.escape(f"{copy} differs from ")):
        hf_to_moepar(str(src), str(tmp_path / "mp"), log=lambda _m: None)
    assert not (tmp_path / "mp").exists()
