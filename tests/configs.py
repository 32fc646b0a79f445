"""Tiny run configs shared by the tests: a 2-layer, 4-expert model that trains in a second."""

from moepar.config import load_config


def tiny_config(run_dir, *overrides):
    """A 2-layer, 4-expert model on the builtin corpus; overrides as '--section.key=value'."""
    base = ["--model.dim=32", "--model.num_layers=2", "--model.num_heads=4", "--model.num_kv_heads=2",
            "--model.ffn_dim=64", "--model.moe_ffn_dim=32", "--model.num_experts=4",
            "--model.top_k=2", "--model.max_seq_len=32", "--train.seq_len=32",
            "--train.micro_batch_size=2", "--train.global_batch_size=4", "--train.steps=6",
            "--train.warmup_steps=2", "--train.lr=3e-3", "--run.log_every=0",
            "--run.tensorboard=false", f"--run.dir={run_dir}"]
    return load_config(None, base + list(overrides))
