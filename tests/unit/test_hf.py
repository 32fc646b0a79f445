"""Hugging Face conversion against transformers itself: tiny random models built with its config
classes (no download), logits equal, round trips exact, bad checkpoints refused by name."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from moepar.hf import ConversionError, from_hf, hf_to_moepar, moepar_to_hf  # noqa: E402
from moepar.train import Trainer  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
              initializer_range=0.1)   # large init: no near-ties that could flip routing
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=56,
        num_experts=4, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=40, moe_intermediate_size=24, num_experts=4, norm_topk_prob=True,
        head_dim=16, decoder_sparse_step=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=24, num_experts=4)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        routed_scaling_factor=2.5)),
}


def hf_model(arch: str, tmp_path, **extra):
    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(0)
    common = dict(COMMON, num_key_value_heads=4) if arch == "deepseek_v3" else COMMON  # MLA: no GQA
    config = getattr(transformers, config_cls)(**common, **{**kwargs, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():   # DeepSeek's score-correction bias must steer selection, not sit at 0
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    path = tmp_path / arch
    model.save_pretrained(path)
    return model, str(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers(arch, tmp_path):
    model, path = hf_model(arch, tmp_path)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        got = from_hf(path)(ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_identical(arch, tmp_path):
    from safetensors.torch import load_file
    _, path = hf_model(arch, tmp_path)
    hf_to_moepar(path, str(tmp_path / "mp"))
    moepar_to_hf(str(tmp_path / "mp"), str(tmp_path / "back"), max_shard_bytes=20_000)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(os.path.exists(tmp_path / "back" / f) for f in files)
    back = {}
    for f in files:
        back.update(load_file(tmp_path / "back" / f))
    original = load_file(os.path.join(path, "model.safetensors"))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in back.values())
    assert set(back) == set(original) - {n for n in original if n.endswith("inv_freq")}
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads(open(os.path.join(path, "config.json")).read())


def test_sharded_and_stacked_sources(tmp_path):
    """A sharded HF folder (index json) whose experts are stored stacked converts too."""
    from safetensors.torch import load_file, save_file
    model, path = hf_model("mixtral", tmp_path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for i in range(3):
        pre = f"model.layers.{i}.block_sparse_moe.experts"
        gate_up = torch.stack([torch.cat([tensors.pop(f"{pre}.{e}.w1.weight"),
                                          tensors.pop(f"{pre}.{e}.w3.weight")]) for e in range(4)])
        down = torch.stack([tensors.pop(f"{pre}.{e}.w2.weight") for e in range(4)])
        tensors[f"{pre}.gate_up_proj"], tensors[f"{pre}.down_proj"] = gate_up, down
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(os.path.join(path, "config.json"), sharded)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k].contiguous() for k in keys}, sharded / file)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(str(sharded))(ids), model(ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("damage, message", [
    ("drop", "lacks 1 tensor"),
    ("extra", "unexpected tensor 'model.layers.0.block_sparse_moe.experts.9.w1.weight'"),
    ("shape", "has shape"),
])
def test_incomplete_or_wrong_checkpoint_named(damage, message, tmp_path):
    from safetensors.torch import load_file, save_file
    _, path = hf_model("mixtral", tmp_path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    if damage == "drop":
        del tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    elif damage == "extra":
        tensors["model.layers.0.block_sparse_moe.experts.9.w1.weight"] = torch.zeros(48, 32)
    else:
        tensors["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ConversionError, match=message.replace(".", r"\.").replace("'", ".")):
        hf_to_moepar(path, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConversionError, match="mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3"):
        from_hf(str(tmp_path))


def test_deepseek_without_q_lora_and_generated_config(tmp_path):
    """q_lora_rank=None uses a plain q projection; a model whose config.json is generated by
    moepar (no hf_config.json) loads in transformers with the same logits."""
    model, path = hf_model("deepseek_v3", tmp_path, q_lora_rank=None)
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(path)(ids), model(ids).logits, rtol=1e-5, atol=1e-5)
    hf_to_moepar(path, str(tmp_path / "mp"))
    os.remove(tmp_path / "mp" / "hf_config.json")
    manifest = json.loads((tmp_path / "mp" / "manifest.json").read_text())
    del manifest["files"]["hf_config.json"]
    (tmp_path / "mp" / "manifest.json").write_text(json.dumps(manifest))
    moepar_to_hf(str(tmp_path / "mp"), str(tmp_path / "back"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_finetune_converted_model_and_export(tmp_path):
    """HF -> moepar -> `moepar train` a few steps -> HF; transformers loads it, same logits."""
    _, path = hf_model("qwen3_moe", tmp_path)
    hf_to_moepar(path, str(tmp_path / "mp"))
    tokens = np.random.default_rng(0).integers(0, 64, size=5000).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    cfg_path = str(tmp_path / "mp" / "config.toml")
    from moepar.config import load_config
    cfg = load_config(cfg_path, ["--data.source=tokens", f"--data.path={tmp_path / 'tokens.npy'}",
                                 f"--run.init_from={tmp_path / 'mp'}", f"--run.dir={tmp_path / 'run'}",
                                 "--train.steps=3", "--train.seq_len=16", "--train.micro_batch_size=2",
                                 "--train.global_batch_size=4", "--train.warmup_steps=1",
                                 "--run.log_every=0", "--run.tensorboard=false"])
    trainer = Trainer(cfg, log=lambda _m: None)
    records = trainer.run()
    assert records[-1]["loss"] < records[0]["loss"] + 0.5 and not any(r["skipped"] for r in records)
    moepar_to_hf(str(tmp_path / "run" / "checkpoints" / "step_3"), str(tmp_path / "back"), "qwen3_moe")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.model(ids)[0], rtol=1e-5, atol=1e-5)
