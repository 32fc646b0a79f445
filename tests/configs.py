"""Tiny run configs shared by the tests: a 2-layer, 4-expert model that trains in a second."""

import json
import os
import shlex

import torch

from moepar.checkpoint import load_checkpoint
from moepar.config import load_config
from moepar.data.prepare import PrepareOptions, prepare
from moepar.layers import ModelConfig, RouterConfig, Transformer


def tiny_config(run_dir, *overrides):
    """A 2-layer, 4-expert model on the builtin corpus; overrides as '--section.key=value'."""
    base = ["--model.dim=32", "--model.num_layers=2", "--model.num_heads=4", "--model.num_kv_heads=2",
            "--model.ffn_dim=64", "--model.moe_ffn_dim=32", "--model.num_experts=4",
            "--model.top_k=2", "--model.max_seq_len=32", "--train.seq_len=32",
            "--train.micro_batch_size=2", "--train.global_batch_size=4", "--train.steps=6",
            "--train.warmup_steps=2", "--train.lr=3e-3", "--run.log_every=0",
            "--run.tensorboard=false", f"--run.dir={run_dir}"]
    return load_config(None, base + list(overrides))


def packed_folder(tmp, num_docs: int, **options) -> str:
    """A folder prepared (byte tokenizer; no validation split by default) from `num_docs` documents of
    9 to 45 bytes, for data.pack tests; `options`: more PrepareOptions fields. Returns its path."""
    text = "\n\n".join(f"doc {i}: " + "moe " * (i % 10) for i in range(num_docs))
    (tmp / "docs.txt").write_text(text)
    out = str(tmp / "docs")
    options.setdefault("val_fraction", 0.0)
    prepare(PrepareOptions("bytes", [str(tmp / "docs.txt")], out, split_blank_lines=True,
                           **options), stderr=open(os.devnull, "w"))
    return out


def tiny_model(**overrides):
    """A float64 4-layer, 4-expert Transformer (vocabulary 64) with capacity and aux losses."""
    cfg = dict(vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=64,
               moe_ffn_dim=32, num_experts=4, top_k=2, max_seq_len=16)
    cfg.update(overrides)
    torch.manual_seed(0)
    router = RouterConfig(capacity_factor=1.0, z_coeff=1e-3, seq_balance_coeff=1e-2)
    return Transformer(ModelConfig(**cfg), router).double()


def token_batches(m: int, seed: int = 1):
    """m micro-batches of 2 sequences of 8 ids < 64: (inputs, targets) lists."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(m)]
    targets = [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(m)]
    return inputs, targets


def tiny_mixtral(folder, **fields):
    """A tiny random Mixtral saved by transformers at `folder` (no download), drawn after
    torch.manual_seed(0); `fields` override its config (vocabulary, layers, EOS, ...). Returns
    the model, in eval mode."""
    import transformers
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=64)
    config.update(fields)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**config)).eval()
    model.save_pretrained(folder)
    return model


def example_commands(example, run_dir, run_name: str, last_step: str) -> list[list[str]]:
    """The `#   moepar ...` commands of an example's header (argv after `moepar`), pointed at
    run_dir instead of runs/<run_name> and shortened to a 3-step training run whose last
    checkpoint stands in for `last_step` (e.g. "step_200")."""
    out = []
    for line in example.read_text().splitlines():
        if not line.startswith("#   moepar "):
            continue
        words = [w.replace(f"runs/{run_name}", str(run_dir)).replace(last_step, "step_3")
                 for w in shlex.split(line.lstrip("# "))[1:]]
        if words[0] == "train":
            words += ["--train.steps=3", "--train.warmup_steps=1", "--run.log_every=1",
                      "--run.tensorboard=false", f"--run.dir={run_dir}"]   # not the config's
        out.append(words)
    return out


def checkpoint_model(checkpoint) -> Transformer:
    """The one-process model of a checkpoint folder, built from its state.json config and loaded."""
    config = json.loads((checkpoint / "state.json").read_text())["config"]
    model = Transformer(ModelConfig(**config["model"]), RouterConfig(**config["router"]))
    load_checkpoint(str(checkpoint), model)
    return model
