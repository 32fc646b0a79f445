"""`moepar bench memory`: bytes per rank of parameters, gradients and optimizer state, measured
and beside the ZeRO formula, for a model of a chosen size under --zero Z --dp N --ep M.

Measured on a real Trainer (gloo, one process per rank): one step creates the AdamW state, then a
second forward/backward leaves the gradients exactly as the optimizer step would see them.
Bytes are counted by storage (views of one flat buffer count once), local shards only.

The formula, with P, G, O the bytes per element of parameters, gradients and optimizer state,
Φd the dense parameter count, Φe the expert parameters on this EP rank (experts / ep), and the
dense (dp) and expert (edp) group sizes Nd and Ne:

| zero | parameters         | gradients          | optimizer state     |
|------|--------------------|--------------------|---------------------|
| 0    | P (Φd + Φe)        | G (Φd + Φe)        | O (Φd + Φe)         |
| 1    | P (Φd + Φe)        | G (Φd + Φe)        | O (Φd/Nd + Φe/Ne)   |
| 2    | P (Φd + Φe)        | G (Φd/Nd + Φe/Ne)  | O (Φd/Nd + Φe/Ne)   |
| 3    | P (Φd/Nd + Φe/Ne)  | G (Φd/Nd + Φe/Ne)  | O (Φd/Nd + Φe/Ne)   |

moepar keeps fp32 parameters (bf16 comes from autocast), so P=4, G=4, O=8 (AdamW m and v): DDP
16 bytes/param, ZeRO-1 8+8/N, ZeRO-2 4+12/N, ZeRO-3 16/N. The ZeRO paper's mixed precision (bf16
parameters and gradients, fp32 master copy + m + v: P=2, G=2, O=12) gives 16, 4+12/N, 2+14/N,
16/N; the totals match at stage 0 and 3. train.optim_state_dtype = "bfloat16" stores m and v in
bf16: O=4.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from moepar.config import load_config
from moepar.layers.attention import Attention
from moepar.layers.mla import MLA
from moepar.metrics import StepStats
from moepar.parallel.grads import split_parameters
from moepar.process import end_process_group
from moepar.train import Trainer

__all__ = ["measure", "formula", "worker_main"]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def attention_and_embedding_bytes(model) -> dict:
    """Parameter bytes this rank holds for attention blocks and for the embedding + LM head."""
    attn = [p for m in model.modules() if isinstance(m, (Attention, MLA)) for p in m.parameters()]
    embed = [p for name in ("embed", "head") if getattr(model, name, None) is not None
             for p in getattr(model, name).parameters()]
    return {"attention": _storage_bytes(attn), "embedding_and_head": _storage_bytes(embed)}


def measure(trainer) -> dict:
    """Bytes this rank holds, with gradients as the optimizer step sees them (after the sync)."""
    model, optimizer = trainer.model, trainer.optimizer
    stats = StepStats(len(trainer.engine.moe_layer_ids), trainer.cfg.model.num_experts,
                      trainer.device)
    trainer.forward_backward(stats)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    inner = getattr(optimizer, "inner", optimizer)
    grads += [p.grad for group in inner.param_groups for p in group["params"]]
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    result = {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
              "optimizer": _storage_bytes(state), **attention_and_embedding_bytes(model)}
    optimizer.zero_grad(set_to_none=True)
    return result


def formula(trainer) -> dict:
    """The table above for this trainer's model, layout and dtype."""
    dims, zero = trainer.dims, trainer.cfg.parallel.zero
    dense, experts = split_parameters(trainer.model)
    numel = lambda ps: sum(p.numel() for p in ps)          # noqa: E731 - global shapes
    phi_d, phi_e = numel(dense), numel(experts)
    nd, ne = (dims.dp, dims.edp) if dims.world_size > 1 else (1, 1)
    elem = next(trainer.model.parameters()).element_size()
    moment = 2 if trainer.cfg.train.optim_state_dtype == "bfloat16" else elem
    p_bytes, g_bytes, o_bytes = elem, elem, 2 * moment
    full, shard = phi_d + phi_e, phi_d / nd + phi_e / ne
    return {"params": p_bytes * (shard if zero == 3 else full),
            "grads": g_bytes * (shard if zero >= 2 else full),
            "optimizer": o_bytes * (shard if zero >= 1 else full),
            "dense_params": phi_d, "expert_params_per_rank": phi_e,
            "total_params": phi_d + phi_e * dims.ep}


def worker_main(args) -> dict:
    """Runs on every rank; returns {'ranks': [per-rank measured/formula], ...} (rank 0 prints)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            overrides = [f"--model.dim={args.dim}", f"--model.num_layers={args.layers}",
                         f"--model.num_heads={args.heads}",
                         f"--model.num_kv_heads={args.kv_heads or args.heads}",
                         f"--model.ffn_dim={2 * args.dim}", f"--model.moe_ffn_dim={args.dim}",
                         f"--model.num_experts={args.experts}", "--model.max_seq_len=64",
                         "--train.seq_len=64", f"--train.micro_batch_size={args.micro_batch}",
                         f"--train.global_batch_size={args.micro_batch * args.dp}",
                         f"--parallel.dp={args.dp}", f"--parallel.tp={args.tp}",
                         f"--parallel.ep={args.ep}",
                         f"--parallel.zero={args.zero}", "--run.tensorboard=false",
                         "--run.log_every=0", f"--run.dir={tmp}"]
            trainer = Trainer(load_config(None, overrides), log=lambda _m: None,
                              shared_run_dir=False)   # a scratch dir per rank, no saves
            trainer.train_step()                     # creates the optimizer state
            # The formula is ZeRO's (dense over dp, experts over edp); tensor parallelism shards
            # attention and embeddings on top, reported on their own.
            mine = {"measured": measure(trainer),
                    "formula": formula(trainer) if args.tp == 1 else None}
            ranks = [mine] if not dist.is_initialized() else [None] * dist.get_world_size()
            if dist.is_initialized():
                dist.all_gather_object(ranks, mine)
        first = ranks[0]["formula"] or {}
        return {"zero": args.zero, "dp": args.dp, "tp": args.tp, "ep": args.ep,
                "edp": args.dp * args.tp // args.ep, "total_params": first.get("total_params"),
                "dense_params": first.get("dense_params"),
                "expert_params_per_rank": first.get("expert_params_per_rank"), "ranks": ranks}
    finally:
        end_process_group(clean=sys.exc_info()[0] is None)


def print_result(result: dict):
    if result["tp"] > 1:
        print(f"memory: tp={result['tp']} dp={result['dp']} ep={result['ep']} zero={result['zero']}"
              "; parameter bytes per rank")
        for rank, r in enumerate(result["ranks"]):
            m = r["measured"]
            print(f"  rank {rank}: attention {m['attention']:,} B, embedding + head "
                  f"{m['embedding_and_head']:,} B, all parameters {m['params']:,} B")
        return
    m = result["ranks"][0]["measured"]
    print(f"parameter bytes on rank 0: attention {m['attention']:,} B, embedding + head "
          f"{m['embedding_and_head']:,} B")
    total = result["total_params"]
    print(f"memory: zero={result['zero']} dp={result['dp']} ep={result['ep']} "
          f"edp={result['edp']}; {total:,} parameters ({result['dense_params']:,} dense, "
          f"{result['expert_params_per_rank']:,} expert per EP rank)")
    print(f"  {'rank':>4} {'part':<10} {'measured B':>12} {'formula B':>12} {'ratio':>6} "
          f"{'B/param':>8}")
    for rank, r in enumerate(result["ranks"]):
        for part in ("params", "grads", "optimizer"):
            got, want = r["measured"][part], r["formula"][part]
            print(f"  {rank:>4} {part:<10} {got:>12,} {want:>12,.0f} {got / want:>6.3f} "
                  f"{got / total:>8.2f}")
        got = sum(r["measured"][k] for k in ("params", "grads", "optimizer"))
        want = sum(r["formula"][k] for k in ("params", "grads", "optimizer"))
        print(f"  {rank:>4} {'total':<10} {got:>12,} {want:>12,.0f} {got / want:>6.3f} "
              f"{got / total:>8.2f}")


def launched() -> bool:
    return "WORLD_SIZE" in os.environ
