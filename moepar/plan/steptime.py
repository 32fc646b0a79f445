"""Step time of a layout: compute at a stated fraction of peak, tensor-parallel collectives,
expert all-to-alls (inside a node or across, by `ParallelDims.spans_nodes`), pipeline transfers
and bubble, data-parallel / ZeRO reductions with their overlap, and the optimizer step.

(Not named time.py: a module `time` beside the others would read like the standard library's.)

Per micro-batch on pipeline rank r (T tokens, t = T/tp, rows = t*K*load):

| term       | seconds                                                                          |
|------------|----------------------------------------------------------------------------------|
| compute    | forward FLOPs (flops.py) x (3, + 1 forward of what recompute rebuilds) / (peak * |
|            | compute_efficiency); attention, dense FFN and head split over tp, experts by rows|
| tp         | per attention / dense FFN: all-gather + reduce-scatter of T*D (x2 in backward,   |
|            | again under recompute), each (tp-1)/tp of the bytes, not overlapped              |
| all-to-all | per MoE layer 4 (6 under full recompute) exchanges of rows*D*(ep-1)/ep bytes, at |
|            | NVLink speed when the ep group stays in a node, else its off-node share at the   |
|            | network's; not overlapped (moepar's dispatch waits for it). The hierarchical     |
|            | dispatcher: its expected off-node rows (dispatch.py) at network speed, then the  |
|            | fan-out inside the node at NVLink speed                                          |
| p2p        | pipeline: the hidden state t*D*4 forward and its gradient back, per chunk        |
| ZeRO-3     | parameters all-gathered in forward and backward, hidden behind compute up to it  |

Pipeline: (m - 1) * slowest stage + (sum of stages) / v (+ (1 - 1/v) slowest): 1F1B's fill and
drain; its idle share with equal stages is `schedules.ideal_bubble`. After the last backward:
the data-parallel reduction (ZeRO-0/1: all-reduce or reduce-scatter of the gradients, started
during the last micro-batch's backward and hidden behind it; ZeRO-2: a reduce-scatter behind
every backward; ZeRO-1/2: the parameters' all-gather after the optimizer step, exposed), then
AdamW, bound by memory bandwidth (~28 bytes per stepped element). Ring collectives move
(n-1)/n of the bytes (all-reduce twice that) per GPU at link speed * comm_efficiency.
"""

from .dispatch import off_node_rows_per_token, unit_hit
from .flops import attention_flops, expert_row_flops, ffn_flops, head_flops, moe_token_flops

__all__ = ["stage_seconds", "step_seconds", "ADAMW_BYTES"]

ADAMW_BYTES = 28     # per stepped element: read p, g, m, v and write p, m, v, in float32


def _ring(n: int, nbytes: float, bw: float, factor: float = 1.0) -> float:
    return factor * (n - 1) / n * nbytes / bw if n > 1 else 0.0


def _bw(gpu, inter: bool) -> float:
    return (gpu.inter_gbps if inter else gpu.intra_gbps) * 1e9 * gpu.comm_efficiency


def stage_seconds(cfg, spec, gpu, stage: dict, links: dict) -> dict:
    """Seconds of one micro-batch on a pipeline rank. `stage`: dense, moe (layer counts), first,
    last, virtual; `links`: {axis: spans nodes} for tp, ep, pp and the ep group's share of ranks
    inside a node."""
    model = cfg.model
    T, t, tp, a = spec.tokens, spec.local_tokens, spec.tp, spec.a
    proj, core = attention_flops(model, spec.seq_len)
    rows = t * model.top_k * spec.row_factor
    attn = T * (proj + core) / tp
    dense = T * ffn_flops(model) / tp
    experts = rows * expert_row_flops(model)
    moe_tokens = t * moe_token_flops(model)
    layers_fwd = stage["dense"] * (attn + dense) + stage["moe"] * (attn + moe_tokens + experts)
    head = T * head_flops(model) / tp if stage["last"] else 0.0
    extra = {"none": 0.0, "full": layers_fwd, "attention": (stage["dense"] + stage["moe"]) * attn,
             "experts": stage["moe"] * experts}[spec.recompute]
    # The fused loss recomputes the head's logits in backward (layers/loss.py): one head forward.
    flops = 3 * (layers_fwd + head) + extra + head
    compute = flops / (gpu.tflops * 1e12 * gpu.compute_efficiency)
    out = {"compute": compute, "backward": (2 * layers_fwd + 3 * head) / (
        gpu.tflops * 1e12 * gpu.compute_efficiency), "tp": 0.0, "a2a": 0.0, "p2p": 0.0}
    if tp > 1:
        regions = 2 * stage["dense"] + stage["moe"]          # attention + dense FFN
        per_region = 4 + (2 if spec.recompute == "full" else 0)
        if spec.recompute == "attention":
            per_region += 2 * (stage["dense"] + stage["moe"]) / max(regions, 1)
        ends = 2 * (stage["first"] + stage["last"])
        nbytes = T * model.dim * a
        out["tp"] = (regions * per_region + ends) * _ring(tp, nbytes, _bw(gpu, links["tp"]))
    if spec.ep > 1 and stage["moe"]:
        exchanges = 4 + (2 if spec.recompute == "full" else 0)
        nbytes = rows * model.dim * a * (spec.ep - 1) / spec.ep
        inside = links["ep_inside"]                  # share of ep peers on this node
        if links["ep"] and cfg.parallel.dispatcher == "hierarchical":
            seconds = _hierarchical_seconds(cfg, spec, gpu, round(inside * spec.ep), a)
        elif links["ep"]:
            off = nbytes * (1 - inside) / _bw(gpu, True)
            on = nbytes * inside / _bw(gpu, False)
            seconds = max(off, on)
        else:
            seconds = nbytes / _bw(gpu, False)
        out["a2a"] = stage["moe"] * exchanges * seconds
    if links["pp_size"] > 1:
        out["p2p"] = 2 * stage["virtual"] * t * model.dim * spec.r / _bw(gpu, links["pp"])
    out["total"] = sum(out[k] for k in ("compute", "tp", "a2a", "p2p"))
    return out


def _hierarchical_seconds(cfg, spec, gpu, ranks_per_node: int, a: int) -> float:
    """One exchange of the hierarchical dispatcher: its rows that leave the node at network
    speed (plan/dispatch.py), then the relay's fan-out to the other ranks of the node on NVLink
    (the distinct ranks a token reaches, but the relay itself)."""
    model, router, ep = cfg.model, cfg.router, spec.ep
    per_token = spec.local_tokens * spec.row_factor * model.dim * a
    off = off_node_rows_per_token("hierarchical", model.num_experts, model.top_k, ep,
                                  ranks_per_node, router.n_group, router.topk_group)
    ranks = ep * unit_hit(model.num_experts // ep, model.num_experts, model.top_k,
                          router.n_group, router.topk_group)
    on = ranks * (ranks_per_node - 1) / ranks_per_node
    return float(off) * per_token / _bw(gpu, True) + float(on) * per_token / _bw(gpu, False)


def _dp_seconds(spec, gpu, stage: dict, links: dict, num_micro: int, wire: int,
                per_micro: dict) -> tuple[float, float]:
    """(exposed seconds after the last backward, exposed seconds per micro-batch) of the
    gradient reduction and ZeRO's parameter gathers on this stage."""
    dense, expert = stage["dense_params"], stage["expert_params"]
    groups = [(links["dp_size"], dense, _bw(gpu, links["dp"])),
              (links["edp_size"], expert, _bw(gpu, links["edp"]))]
    backward = per_micro["backward"]
    reduce_ = sum(_ring(n, phi * wire, bw, 2 if spec.zero == 0 else 1) for n, phi, bw in groups)
    gather = sum(_ring(n, phi * spec.p, bw) for n, phi, bw in groups)
    if spec.zero in (0, 1):
        return max(reduce_ - backward, 0.0) + (gather if spec.zero == 1 else 0.0), 0.0
    if spec.zero == 2:
        return gather + max(reduce_ - backward, 0.0), max(reduce_ - backward, 0.0)
    # ZeRO-3: gather (compute dtype) in forward and again in backward, behind the compute
    gathers = 2 * sum(_ring(n, phi * spec.a, bw) for n, phi, bw in groups)
    return max(reduce_ - backward, 0.0), max(gathers - per_micro["compute"], 0.0)


def step_seconds(cfg, spec, gpu, stages: list[tuple[dict, int]], links: dict, num_micro: int,
                 wire: int) -> dict:
    """The step's time and its parts. `stages`: (stage, how many pipeline ranks it stands for);
    a stage as in stage_seconds, plus dense_params, expert_params and stepped (elements on that
    rank)."""
    per = [stage_seconds(cfg, spec, gpu, s, links) for s, _ in stages]
    dp = [_dp_seconds(spec, gpu, s, links, num_micro, wire, p) for (s, _), p in zip(
        stages, per, strict=True)]
    times = [p["total"] + d[1] for p, d in zip(per, dp, strict=True)]
    slowest = max(range(len(times)), key=times.__getitem__)
    v = stages[0][0]["virtual"]
    if links["pp_size"] == 1:
        pipeline = num_micro * times[0]
    else:
        total = sum(t * n for t, (_, n) in zip(times, stages, strict=True))
        pipeline = (num_micro - 1) * times[slowest] + total / v + (1 - 1 / v) * times[slowest]
    exposed = max(d[0] for d in dp)
    optimizer = max(s["stepped"] for s, _ in stages) * ADAMW_BYTES / (
        gpu.hbm_tbps * 1e12 * gpu.hbm_efficiency)
    step = pipeline + exposed + optimizer
    worst = per[slowest]
    return {"step": step, "pipeline": pipeline, "dp_exposed": exposed, "optimizer": optimizer,
            "compute": num_micro * worst["compute"], "tp": num_micro * worst["tp"],
            "a2a": num_micro * worst["a2a"], "p2p": num_micro * worst["p2p"],
            "zero3_exposed": num_micro * dp[slowest][1]}
