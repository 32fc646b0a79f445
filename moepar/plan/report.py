"""What `moepar plan` prints: the ranked table, the best plan's memory and time breakdown, the
assumptions, one line per rejected family, and the same as one JSON object."""

import dataclasses

from .footprint import ITEMS

__all__ = ["table", "breakdown", "rejected_lines", "assumptions", "to_json", "row"]

GIB = 2 ** 30


def _route(capacity) -> str:
    return "dropless" if capacity is None else f"cf={capacity:g}"


def row(plan) -> dict:
    """One plan as plain numbers (the JSON form, and what the table prints)."""
    lo = plan.layout
    out = {"pp": lo.pp, "virtual": lo.virtual, "schedule": lo.schedule, "dp": lo.dp, "cp": lo.cp,
           "tp": lo.tp,
           "ep": lo.ep, "zero": lo.zero, "micro_batch": lo.micro_batch,
           "recompute": lo.recompute, "capacity_factor": lo.capacity_factor,
           "micro_batches_per_step": plan.num_micro, "fits": plan.fits, "reason": plan.reason,
           "memory_gib": plan.memory["total"] / GIB, "memory_pp_rank": plan.memory_rank,
           "memory_bytes": {k: plan.memory[k] for k in ITEMS}}
    if plan.fits or plan.time.get("step", float("inf")) != float("inf"):
        out.update(step_s=plan.time["step"], tokens_per_s_gpu=plan.tokens_per_s_gpu, mfu=plan.mfu,
                   bubble=plan.bubble, a2a_share=plan.a2a_share, time_s=dict(plan.time))
    return out


def table(plans: list, top: int) -> list[str]:
    head = (f"{'#':>3}  {'pp':>5} {'dp':>4} {'cp':>3} {'tp':>2} {'ep':>3} {'zero':>4} {'mbs':>3} "
            f"{'recompute':<9} {'routing':<8} {'GiB/GPU':>7} {'step s':>7} {'tok/s/GPU':>9} "
            f"{'MFU':>5} {'bubble':>6} {'a2a':>5}")
    lines = [head]
    for i, p in enumerate(plans[:top], 1):
        lo = p.layout
        pp = f"{lo.pp}x{lo.virtual}" if lo.virtual > 1 else str(lo.pp)
        if lo.schedule == "gpipe":
            pp += "g"
        lines.append(
            f"{i:>3}  {pp:>5} {lo.dp:>4} {lo.cp:>3} {lo.tp:>2} {lo.ep:>3} {lo.zero:>4} {lo.micro_batch:>3} "
            f"{lo.recompute:<9} {_route(lo.capacity_factor):<8} "
            f"{p.memory['total'] / GIB:>7.1f} {p.time['step']:>7.2f} {p.tokens_per_s_gpu:>9,.0f} "
            f"{100 * p.mfu:>4.1f}% {100 * p.bubble:>5.1f}% {100 * p.a2a_share:>4.1f}%")
    return lines


def breakdown(plan) -> list[str]:
    m, t = plan.memory, plan.time
    parts = ", ".join(f"{k} {m[k] / GIB:.1f}" for k in ITEMS if m[k] >= 0.05 * GIB)
    lines = [f"memory of #1 (pp rank {plan.memory_rank}, {m['in_flight']} micro-batch(es) in "
             f"flight), GiB: {parts}; total {m['total'] / GIB:.1f}"]
    parts = ", ".join(f"{k} {t[k]:.2f}" for k in ("compute", "tp", "cp", "a2a", "p2p", "zero3_exposed")
                      if t[k] >= 0.005)
    lines.append(f"step of #1, s: pipeline {t['pipeline']:.2f} (of which on the slowest stage "
                 f"{parts}; bubble {100 * plan.bubble:.1f}%), data-parallel sync exposed "
                 f"{t['dp_exposed']:.2f}, optimizer {t['optimizer']:.2f}; total {t['step']:.2f}")
    return lines


def _group(families: list[tuple]) -> str:
    """'pp 1,2 x tp 1,2 x ep 16' when the families are that product, else per pp and tp:
    'pp 2: tp 1 ep 1,2,4; tp 2 ep 1,2'."""
    axes = [sorted({f[i] for f in families}) for i in range(3)]
    if len(axes[0]) * len(axes[1]) * len(axes[2]) == len(set(families)):
        return " x ".join(f"{name} {','.join(map(str, a))}" for name, a in
                          zip(("pp", "tp", "ep"), axes, strict=True))
    parts = []
    for pp in axes[0]:
        by_tp = {}
        for f in sorted(families):
            if f[0] == pp:
                by_tp.setdefault(f[1], []).append(str(f[2]))
        parts.append(f"pp {pp}: " + "; ".join(f"tp {t} ep {','.join(e)}" for t, e in
                                               by_tp.items()))
    return " | ".join(parts)


def rejected_lines(rejected: dict, budget_gib: float, max_bubble: float) -> list[str]:
    """The rejected families, grouped: one line per validation error, and per pipeline depth
    for memory and bubble (with the least bad layout of the group)."""
    groups: dict[tuple, list] = {}
    for family, r in rejected.items():
        key = (r["kind"], r["reason"]) if r["kind"] == "indivisible" else (r["kind"], family[0])
        groups.setdefault(key, []).append(family)
    lines = []
    for (kind, what), fams in groups.items():
        if kind == "indivisible":
            lines.append(f"  {_group(fams)}: indivisible: {what}")
            continue
        least = min(fams, key=lambda f: rejected[f]["value"])
        r = rejected[least]
        if kind == "out of memory":
            line = f"out of memory, at least {r['value']:.1f} GiB per GPU > {budget_gib:.1f} GiB"
        else:
            line = (f"bubble too large, at least {100 * r['value']:.0f}% > "
                    f"{100 * max_bubble:.0f}% among the layouts that fit in memory")
        lines.append(f"  {_group(fams)}: {line} ({r['closest']})")
    return lines


def assumptions(req, imbalance_source: str) -> list[str]:
    g = req.gpu
    return [
        f"hardware {g.name}: {g.memory_gib:g} GiB, {g.tflops:g} TFLOP/s bf16, HBM {g.hbm_tbps:g} "
        f"TB/s, NVLink {g.intra_gbps:g} GB/s and network {g.inter_gbps:g} GB/s per GPU; "
        f"{req.gpus_per_node} GPUs per node",
        f"assumed: compute at {100 * g.compute_efficiency:.0f}% of peak, collectives at "
        f"{100 * g.comm_efficiency:.0f}% of link bandwidth, optimizer at "
        f"{100 * g.hbm_efficiency:.0f}% of HBM bandwidth; {g.overhead_gib:g} GiB framework "
        f"overhead and {100 * (1 - g.usable_fraction):.0f}% allocator margin per GPU "
        f"(budget {g.budget_bytes / GIB:.1f} GiB + overhead)",
        f"dropless imbalance (busiest EP rank's rows / mean): {req.imbalance:g} ({imbalance_source});"
        f" bubble at most {100 * req.max_bubble:.0f}%; all-to-all, tp collectives and pipeline "
        "transfers are not overlapped with compute, gradient reductions overlap the last backward",
    ]


def to_json(req, plans: list, rejected: dict, top: int, extra: dict) -> dict:
    """`plans`: every costed plan, fitting ones first (the first `top` fitting are listed)."""
    fitting = [p for p in plans if p.fits]
    return {"world": req.world, "gpus_per_node": req.gpus_per_node, "seq_len": req.seq_len,
            "global_batch_tokens": req.global_tokens, "gpu": dataclasses.asdict(req.gpu),
            "imbalance": req.imbalance, "max_bubble": req.max_bubble,
            "fitting": len(fitting), "evaluated": len(plans),
            "plans": [row(p) for p in fitting[:top]],
            "rejected": [{"pp": f[0], "tp": f[1], "ep": f[2], **r}
                         for f, r in rejected.items()], **extra}
