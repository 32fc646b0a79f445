"""`moepar bench train --config FILE --against-hf`: moepar's training step against a plain
PyTorch loop over transformers' `MixtralForCausalLM` of the same shapes, in one process.

The baseline is what a user would write without moepar: the Hugging Face model built from the
config.json moepar would export for this model (same layers, widths, heads, experts, top-k,
vocabulary, balance-loss coefficient), random tokens of the same micro-batches, `loss /
micro-batches` backward per micro-batch, `clip_grad_norm_` at train.grad_clip, AdamW with the
same hyperparameters and the same decay split (matrices only), `zero_grad(set_to_none=True)`.
Under train.dtype bfloat16 the plain loop keeps float32 parameters and runs its forward under
`torch.autocast` (the usual way to get bf16 matmuls from a float32 model); float32 runs as is.

The two step functions alternate, timed step by step after their warm-up, so both see the same
machine load (this project's machines are shared); the medians and their ratio come from one
run. Mixtral is dropless, so the config must be too (router.capacity_factor unset), and it must
be a model Mixtral can express (the same check as `moepar convert --to hf --arch mixtral`).
"""

import contextlib
import statistics
import tempfile

import torch

from moepar.bench.ticker import Ticker
from moepar.bench.train import alternate, flops_per_token
from moepar.hf.arch import ARCHS, arch_problems, hf_config_dict
from moepar.train import Trainer

__all__ = ["bench_against_hf", "print_comparison", "hf_mixtral", "check_mixtral"]


def check_mixtral(cfg):
    """Raises ValueError naming what transformers' Mixtral cannot run of cfg (or that
    transformers is missing); builds nothing."""
    try:
        import transformers  # noqa: F401  (only whether it is installed)
    except ImportError:
        raise ValueError("--against-hf needs transformers: pip install 'moepar[hf]'") from None
    problems = arch_problems(ARCHS["mixtral"], cfg.model, cfg.router)
    if cfg.router.capacity_factor is not None:
        problems.append(f"this model has router.capacity_factor={cfg.router.capacity_factor}; "
                        "mixtral is dropless (pass --router.capacity_factor=none)")
    if problems:
        raise ValueError("--against-hf compares with transformers' Mixtral, which cannot run "
                         "this model:\n  " + "\n  ".join(problems))


def hf_mixtral(cfg, experts_implementation: str | None = None):
    """transformers' MixtralForCausalLM with cfg.model's shapes (float32, freshly initialized);
    raises ValueError naming what Mixtral cannot express."""
    check_mixtral(cfg)
    from transformers import MixtralConfig, MixtralForCausalLM
    fields = hf_config_dict(ARCHS["mixtral"], cfg.model, cfg.router)
    fields.update(output_router_logits=cfg.router.balance_coeff > 0, use_cache=False,
                  router_jitter_noise=0.0, attention_dropout=0.0)
    if experts_implementation:
        fields["experts_implementation"] = experts_implementation
    hf_cfg = MixtralConfig(**{k: v for k, v in fields.items() if k != "architectures"})
    return MixtralForCausalLM(hf_cfg)


class _PlainLoop:
    """One optimizer step of the plain loop per call (see the module docstring)."""

    def __init__(self, cfg, device, experts_implementation=None):
        t = cfg.train
        torch.manual_seed(t.seed)
        self.model = hf_mixtral(cfg, experts_implementation).to(device).train()
        self.experts = getattr(self.model.config, "_experts_implementation", None) or "eager"
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                           **kind)
        self.params, self.clip = params, t.grad_clip
        self.num_micro = t.global_batch_size // t.micro_batch_size
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                         if t.dtype == "bfloat16" else None)
        gen = torch.Generator().manual_seed(t.seed)
        self.batches = [torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1),
                                      generator=gen).to(device) for _ in range(self.num_micro)]

    def step(self) -> float:
        total = 0.0
        for tokens in self.batches:
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            with self.autocast or contextlib.nullcontext():
                out = self.model(input_ids=inputs)
            # The next-token loss of moepar's targets (labels already shifted), float32, plus
            # Mixtral's balance loss as its own forward adds it when given labels.
            loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1),
                                                     labels.flatten())
            if out.aux_loss is not None:
                loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss
            (loss / self.num_micro).backward()
            total += loss.detach()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total) / self.num_micro


def bench_against_hf(cfg, steps: int = 10, warmup: int = 2,
                     experts_implementation: str | None = None) -> dict:
    """Median step time of moepar's Trainer and of the plain loop, alternating; their ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg.run.dir, cfg.run.tensorboard = tmp, False
        cfg.train.steps = warmup + steps
        trainer = Trainer(cfg, log=lambda _m: None, shared_run_dir=False)
        device = trainer.device
        plain = _PlainLoop(cfg, device, experts_implementation)
        runs = {"moepar": trainer.train_step, "hf": plain.step}
        times = alternate(runs, device, warmup, steps, Ticker("train --against-hf", warmup, steps))
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    step_s = {name: statistics.median(t) for name, t in times.items()}
    return {"device": str(device), "dtype": cfg.train.dtype, "tokens_per_step": tokens,
            "steps": steps, "hf_experts_implementation": plain.experts,
            "moepar_step_ms": 1000 * step_s["moepar"], "hf_step_ms": 1000 * step_s["hf"],
            "moepar_tokens_per_s": tokens / step_s["moepar"],
            "hf_tokens_per_s": tokens / step_s["hf"],
            "speedup": step_s["hf"] / step_s["moepar"],
            "flops_per_token": flops_per_token(cfg)}


def print_comparison(r: dict):
    print(f"train --against-hf: {r['device']} {r['dtype']}; {r['tokens_per_step']} tokens/step, "
          f"median of {r['steps']} alternating steps: moepar {r['moepar_step_ms']:.1f} ms "
          f"({r['moepar_tokens_per_s']:,.0f} tokens/s), transformers MixtralForCausalLM "
          f"(experts: {r['hf_experts_implementation']}) {r['hf_step_ms']:.1f} ms "
          f"({r['hf_tokens_per_s']:,.0f} tokens/s); moepar is {r['speedup']:.2f}x")
