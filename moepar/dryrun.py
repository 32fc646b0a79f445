"""`moepar train CFG --dry-run`: what a run of CFG would be (the resolved config, the layout, the
parameter counts and each rank's parameter, gradient and AdamW bytes), in pure arithmetic.

    moepar train examples/mixtral_8x7b.toml --nproc 64 --dry-run
    moepar train examples/cluster/moe_cluster.toml --nproc 8 --nnodes 2:4 --rdzv-endpoint h:1 --dry-run

Nothing starts, nothing is written, no lock is taken and no tensor is built: the counts come from
moepar/plan/memory.py's closed forms (which a test checks against the model built on the meta
device), so a 671B-parameter config on 2048 ranks takes well under a second. An elastic job
(--nnodes MIN:MAX) shows its layout at every node count and its memory at MIN nodes, where
ZeRO shards over the fewest ranks and each rank holds the most.
"""

import dataclasses

from moepar.build import COMPUTE_DTYPES, PARAM_DTYPES, build_dims
from moepar.config import to_toml
from moepar.layers.shapes import param_count, tensor_shapes
from moepar.plan.activations import ActSpec, rows_per_rank
from moepar.plan.footprint import rank_footprint
from moepar.plan.memory import moment_bytes, rank_memory
from moepar.progress import count_text

__all__ = ["dry_run", "dry_run_text", "rank_kinds"]

GIB = 2 ** 30


def rank_kinds(cfg, dims) -> list[dict]:
    """Ranks grouped by what they hold: [{ranks, pp, memory (rank_memory)}], one per distinct
    breakdown, in rank order of their first member (with pp > 1, usually one per stage)."""
    p = cfg.parallel
    element = PARAM_DTYPES[cfg.train.dtype].itemsize     # bf16/fp16 train fp32 masters ...
    compute = COMPUTE_DTYPES[cfg.train.dtype].itemsize if cfg.train.dtype in COMPUTE_DTYPES else 0
    shapes = tensor_shapes(cfg.model, tp=dims.tp)
    kinds: dict[tuple, dict] = {}
    for rank in range(dims.world_size):
        memory = rank_memory(cfg.model, dims, rank, p.zero, element, p.pp_virtual,
                             p.pp_layers or None, shapes=shapes, compute_bytes=compute,
                             moment_bytes=moment_bytes(cfg.train))
        # ... and keep their bf16 compute weights beside them (parallel/precision.py)
        memory["params"] += memory.pop("compute_weights")
        key = tuple(sorted(memory.items()))
        if key not in kinds:
            kinds[key] = {"ranks": [], "pp": set(), "memory": memory}
        kinds[key]["ranks"].append(rank)
        kinds[key]["pp"].add(dims.coords(rank).pp)
    return [{**k, "pp": sorted(k["pp"])} for k in kinds.values()]


def dry_run(cfg, nproc: int, nodes=None) -> dict:
    """The dry run's numbers. `nodes`: the node counts of --nnodes (None: one node of nproc)."""

    counts = list(nodes) if nodes else [1]
    if nodes and not cfg.parallel.gpus_per_node:
        # the launcher will set LOCAL_WORLD_SIZE=nproc on every node: the same node size here
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                    gpus_per_node=nproc))
    layouts = [(n, build_dims(cfg, n * nproc)) for n in counts]
    dims = layouts[0][1]
    return {"params": param_count(cfg.model), "nproc": nproc, "multinode": bool(nodes),
            "layouts": [{"nodes": n, "world": d.world_size, "describe": d.describe(),
                         "nodes_describe": d.describe_nodes() if d.gpus_per_node else ""}
                        for n, d in layouts],
            "memory_world": dims.world_size, "kinds": rank_kinds(cfg, dims)}


def activations(cfg, dims) -> dict:
    """`moepar plan`'s activation estimate for rank 0 on GPUs (dropless at an imbalance of 1.5):
    {'positions': per sequence on a rank, 'saved' (kept for backward by one micro-batch's
    layers), 'total' (what is alive at the peak, every micro-batch in flight), bytes}."""
    t, p, model = cfg.train, cfg.parallel, cfg.model
    rows = rows_per_rank(dims.ep, model.top_k, cfg.router.capacity_factor, 1.5)
    spec = ActSpec(t.micro_batch_size, t.seq_len, dims.tp, dims.ep, t.dtype, p.zero, t.recompute,
                   rows, fp32_residual=t.fp32_residual, cp=dims.cp)
    num_micro = t.global_batch_size // (t.micro_batch_size * dims.dp)
    out = rank_footprint(cfg, dims, 0, spec, num_micro=num_micro, schedule=p.pp_schedule,
                         virtual=p.pp_virtual, pp_layers=p.pp_layers or None)
    return {"positions": t.seq_len // dims.cp, "in_flight": out["in_flight"],
            "total": out["activations"] + out["recompute"]}


def _ranks(ranks: list[int]) -> str:
    """'0-15' for a contiguous run, else the first few and a count."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
    head = ", ".join(map(str, ranks[:4]))
    return head + (f", ... ({len(ranks)} ranks)" if len(ranks) > 4 else "")


def _routing(model) -> str:
    """How many experts a token uses, or that the model has none (every layer dense)."""
    moe = sum(map(model.is_moe_layer, range(model.num_layers)))
    if not moe:
        return f"dense: no MoE layer, every one of the {model.num_layers} layers a plain FFN"
    return f"top_k {model.top_k} of {model.num_experts} experts in {moe} of {model.num_layers} layers"


def dry_run_text(cfg, nproc: int, nodes=None) -> str:
    r = dry_run(cfg, nproc, nodes)
    p = r["params"]
    out = ["# moepar train --dry-run: nothing was started or written", "",
           "# resolved config", to_toml(cfg).rstrip(), "", "# layout"]
    for lay in r["layouts"]:
        where = f"{lay['nodes']} node(s) x {nproc} process(es): " if r["multinode"] else ""
        out.append(where + lay["describe"] + (f"; {lay['nodes_describe']}"
                                              if lay["nodes_describe"] else ""))
    out += ["", "# parameters",
            f"total {p['total']:,} ({count_text(p['total'])}): dense {p['dense']:,}, "
            f"experts {p['expert']:,}",
            f"active per token {p['active']:,} ({count_text(p['active'])}; {_routing(cfg.model)})",
            ""]
    zero = cfg.parallel.zero
    smallest = " (the smallest world of --nnodes)" if len(r["layouts"]) > 1 else ""
    out.append(f"# memory per rank (world {r['memory_world']}{smallest}, zero {zero}, "
               f"{cfg.train.dtype}): "
               "parameters, gradients and AdamW state, GiB; activations come on top "
               "(`moepar plan` estimates them)")
    for k in r["kinds"]:
        m = k["memory"]
        total = m["params"] + m["grads"] + m["optimizer"]
        pp = ",".join(map(str, k["pp"]))
        out.append(f"pp {pp}, ranks {_ranks(k['ranks'])}: params {m['params'] / GIB:.2f}, grads "
                   f"{m['grads'] / GIB:.2f}, optimizer {m['optimizer'] / GIB:.2f}, total "
                   f"{total / GIB:.2f}; holds {m['dense_params'] + m['expert_params']:,} "
                   f"parameters (dense {m['dense_params']:,}, experts {m['expert_params']:,})")
    act = activations(cfg, build_dims(cfg, r["memory_world"]))
    out += ["", f"# activations on rank 0 (`moepar plan`'s estimate on GPUs): "
                f"{act['total'] / GIB:.2f} GiB at the peak, {act['in_flight']} micro-batch(es) of "
                f"{cfg.train.micro_batch_size} in flight, {act['positions']:,} positions of each "
                f"sequence per rank (train.seq_len / parallel.cp)"]
    return "\n".join(out)
