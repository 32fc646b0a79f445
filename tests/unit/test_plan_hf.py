"""`moepar plan` on Hugging Face configs: for every architecture `moepar convert` reads, a tiny
config.json written by transformers' own config class plans (given as the folder, the file, or a
file of another name) to the same model `read_hf_config` reads, and its written plan loads in
the trainer's loader with the planned layout."""

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

from moepar.config import load_config  # noqa: E402
from moepar.hf.arch import ARCHS as SUPPORTED, read_hf_config  # noqa: E402
from moepar.plan.cli import main  # noqa: E402
from moepar.plan.source import load_model  # noqa: E402
from moepar.build import build_dims  # noqa: E402

COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256)
ARCHS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=96, num_local_experts=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=80, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=96, num_experts=8,
                                         mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=80, moe_intermediate_size=48,
                                         num_experts=8, head_dim=16, decoder_sparse_step=2)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=48, num_experts=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        intermediate_size=80, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)),
}


def test_every_architecture_convert_reads_is_covered():
    assert set(ARCHS) == set(SUPPORTED)


def hf_folder(arch: str, tmp_path) -> str:
    cls, kwargs = ARCHS[arch]
    config = getattr(transformers, cls)(**{**COMMON, **kwargs})
    path = tmp_path / arch
    config.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_config_plans_and_writes_a_runnable_config(arch, tmp_path, capsys):
    folder = hf_folder(arch, tmp_path)
    _, want, router = read_hf_config(folder)
    other = tmp_path / f"{arch}.json"
    shutil.copyfile(f"{folder}/config.json", other)
    for given in (folder, f"{folder}/config.json", str(other)):
        cfg, source = load_model(given)
        assert cfg.model == want and cfg.router == router, given
        assert arch in source
    out = tmp_path / "plan.toml"
    rc = main([str(other), "--gpus", "8", "--seq-len", "128", "--global-batch-tokens", "4096",
               "--json", "--write", str(out)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fitting"] > 0 and report["written"] == str(out)
    best = report["plans"][0]
    back = load_config(str(out))
    dims = build_dims(back, 8)
    assert back.model == want
    assert (dims.pp, dims.dp, dims.tp, dims.ep) == (best["pp"], best["dp"], best["tp"], best["ep"])
    assert back.train.seq_len == 128 and back.train.global_batch_size == 4096 // 128
