"""Memory per rank at its peak, with the breakdown `moepar plan` prints: parameters, gradients and
optimizer state (closed form, memory.py), activations for the micro-batches a pipeline schedule
keeps in flight (activations.py), MoE dispatch buffers, the recompute working set, communication
buffers, the backward's transient peak, and a fixed framework overhead.

| item           | what                                                                        |
|----------------|-----------------------------------------------------------------------------|
| params, grads, | exactly `rank_memory` (what the meta-device simulation counts)              |
|   optimizer    |                                                                             |
| grad_accum     | ZeRO-3 with > 1 micro-batch: FSDP2 accumulates unsharded gradients (the     |
|                | bytes beyond the sharded ones)                                              |
| activations    | in-flight micro-batches x saved bytes of this rank's layers (+ embedding,   |
|                | head), and the bf16 weight copies (shared when several are in flight)       |
| moe_dispatch   | in-flight x the expert rows' saved bytes (capacity or imbalance factor)     |
| recompute      | one region's activations, rebuilt in backward                               |
| comm_buffers   | ZeRO-0/2 flat gradient copies (ZeRO-2: at most IN_FLIGHT + 1 buckets of     |
|                | parallel.bucket_mb), ZeRO-3 gathered blocks, all-to-all send/receive rows,  |
|                | pipeline stage outputs and receive buffers                                  |
| transient      | backward's working set: the fused loss's on the last stage (one chunk's     |
|                | logits, dh, dW and its float32 sum), or a layer's largest gradient buffer   |
|                | (SwiGLU's [rows, 2F])                                                       |
| overhead       | fixed (the GPU's CUDA context, workspaces, NCCL); 0 for CPU estimates        |

In-flight micro-batches per pipeline rank r (p ranks, m micro-batches, v chunks per rank), the
closed forms of `schedules.peak_in_flight` (a test checks them against the schedules): gpipe m;
1f1b min(p - r, m); interleaved m*v when m == p, else min(2(p-r-1) + (v-1)p + 1, m*v)
chunk-micro-batches, each about 1/v of the rank's layers.
"""

from moepar.layers.loss import chunk_tokens
from moepar.parallel.pipeline import rank_chunks, split_layers
from moepar.parallel.zero import ZeroReducer

from .activations import ActSpec, embed_bytes, head_bytes, layer_bytes
from .memory import bucket_sizes, rank_memory

__all__ = ["in_flight", "rank_footprint", "stage_layers", "ITEMS"]

ITEMS = ("params", "grads", "optimizer", "grad_accum", "activations", "moe_dispatch",
         "recompute", "comm_buffers", "transient", "overhead")


def in_flight(schedule: str, pp: int, pp_rank: int, num_micro: int, virtual: int = 1) -> int:
    """Chunk-micro-batches whose activations pipeline rank `pp_rank` holds at once."""
    if pp == 1:
        return 1
    m, p, r, v = num_micro, pp, pp_rank, virtual
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - r, m)
    if m == p:
        return m * v
    return min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)


def stage_layers(num_layers: int, pp: int, pp_rank: int, virtual: int = 1,
                 pp_layers: list[int] | None = None) -> tuple[list[int], bool, bool]:
    """(layer ids, holds the embedding, holds the head) of pipeline rank `pp_rank`."""
    counts = split_layers(num_layers, pp, virtual, pp_layers or None)
    chunks = rank_chunks(pp_rank, pp, virtual)
    layers = [i for c in chunks for i in range(sum(counts[:c]), sum(counts[:c + 1]))]
    return layers, 0 in chunks, pp * virtual - 1 in chunks


def _kinds(cfg, layers: list[int]) -> dict[bool, int]:
    out = {True: 0, False: 0}
    for i in layers:
        out[cfg.is_moe_layer(i)] += 1
    return out


def rank_footprint(cfg, dims, rank: int, spec: ActSpec, *, num_micro: int, schedule: str = "1f1b",
                   virtual: int = 1, pp_layers: list[int] | None = None,
                   wire_bytes: int | None = None, overhead_bytes: float = 0.0,
                   static: dict | None = None, cache: dict | None = None) -> dict:
    """Bytes of every ITEMS entry on `rank` at its peak, 'total' and 'in_flight'. `cfg` has
    .model and .router; `spec` the micro-batch, dtype, tp, ep, zero and recompute; `wire_bytes`
    the gradient reduction's element size (None: the parameters'); `static` this rank's
    `rank_memory` when the caller has it; `cache` a dict that keeps per-layer bytes between
    calls with the same model."""
    model, router = cfg.model, cfg.router
    coords = dims.coords(rank)
    if static is None:
        static = rank_memory(model, dims, rank, spec.zero, spec.p, virtual, pp_layers,
                             compute_bytes=spec.a if spec.a < spec.p else 0)
    layers, first, last = stage_layers(model.num_layers, dims.pp, coords.pp, virtual, pp_layers)
    kinds = _kinds(model, layers)
    cache = {} if cache is None else cache
    per_kind = {}
    for moe, n in kinds.items():
        if n:
            key = (spec, moe, router.capacity_factor)
            if key not in cache:
                layer = next(i for i in layers if model.is_moe_layer(i) == moe)
                cache[key] = layer_bytes(model, router, layer, spec)
            per_kind[moe] = cache[key]
    sums = {k: sum(per_kind[moe][k] * n for moe, n in kinds.items() if n)
            for k in ("saved", "rows", "weights", "recompute")}
    alive = in_flight(schedule, dims.pp, coords.pp, num_micro, virtual)
    share = 1.0 / virtual          # an interleaved chunk-micro-batch holds ~1/v of the layers
    head = head_bytes(model, spec) if last else {"saved": 0.0, "weights": 0.0}
    head_alive = (num_micro if schedule == "gpipe" else 1) if dims.pp > 1 else 1
    t_bytes = spec.local_tokens * model.dim * spec.r           # one hidden state slice
    activations = alive * share * sums["saved"] + head_alive * head["saved"]
    activations += (alive if first else 0) * embed_bytes(model, spec)
    out = dict.fromkeys(ITEMS, 0.0)
    # (bf16 training: the float32 masters and the bf16 compute weights kept beside them)
    out.update(params=static["params"] + static.get("compute_weights", 0.0),
               grads=static["grads"], optimizer=static["optimizer"],
               activations=activations, moe_dispatch=alive * share * sums["rows"],
               overhead=overhead_bytes)
    # Backward runs the loss first, then one layer at a time (rebuilding its region under
    # recompute) while writing its gradients: the larger of the two on top of what is saved.
    region = max((v["recompute"] for v in per_kind.values()), default=0.0)
    grad = max((v["grad"] for v in per_kind.values()), default=0.0)
    held = 0.0      # the fused loss holds no logits into backward (layers/loss.py)
    loss = _loss_working_set(model, spec, dims.pp) if last else 0.0
    # The micro-batch being backwarded has freed its loss and head by the time its layers run.
    head_one = head["saved"]
    layer_phase = region + grad + (held if region else 0.0) - head_one
    working = max(loss, layer_phase)
    out["recompute"] = min(region, working)
    out["transient"] = working - out["recompute"]
    elements = static["dense_params"] + static["expert_params"]
    if spec.ep > 1 and kinds[True]:
        rows = spec.local_tokens * model.top_k * spec.row_factor
        out["comm_buffers"] += 2 * rows * model.dim * spec.a       # send and receive rows
    if dims.pp > 1:
        out["comm_buffers"] += (alive * share + 2) * t_bytes      # stage outputs, receives
    if spec.zero == 3 and num_micro > 1:   # unsharded until the last micro-batch's reduce
        out["grad_accum"] = elements * spec.p - static["grads"]
    if dims.world_size > 1:
        # Flat gradient copies (ZeRO-2, or a reduced-precision wire) pile up during the step's
        # last backward while its activations are freed; what stays to the end is the first
        # layer's backward (its recompute region and gradient buffer). The peak is the larger
        # of the two phases.
        dynamic = sum(out[k] for k in ("activations", "moe_dispatch", "recompute",
                                       "comm_buffers", "transient"))
        window = 0
        if spec.zero == 2:   # the most buckets' flat copies alive at once (parallel/zero.py)
            bucket_mb = getattr(getattr(cfg, "parallel", None), "bucket_mb", 25.0)
            sizes = bucket_sizes(model, dims, rank, bucket_mb * 2 ** 20, spec.p, virtual,
                                 pp_layers)
            k = ZeroReducer.IN_FLIGHT + 1
            window = max((sum(sizes[i:i + k]) for i in range(len(sizes))), default=0)
        flats, gathered = _sync_buffers(spec, elements, wire_bytes or spec.p, len(layers),
                                        window)
        # (interleaved: the step's last backward covers one chunk; the others' buckets are
        # flattened after it, when no layer is being rebuilt)
        end = flats + held + (region + grad if virtual == 1 else 0.0)
        out["comm_buffers"] += gathered + max(0.0, end - dynamic)
    out["total"] = sum(out[k] for k in ITEMS)
    out["in_flight"] = alive
    return out


def _sync_buffers(spec: ActSpec, elements: int, wire: int, num_layers: int,
                  window: int) -> tuple:
    """Gradient-sync memory beyond the gradients: (flat copies alive when the step's reduction
    ends, buffers alive throughout). `window`: ZeRO-2's most elements in flight."""
    if spec.zero == 2:
        return window * wire, 0.0
    if spec.zero in (0, 1):        # the flat gradient buffers are the gradients (cast if wired)
        return (elements * wire if wire != spec.p else 0.0), 0.0
    # ZeRO-3: the gathered parameters of the running block and the prefetched next one
    return 0.0, 2 * elements / max(num_layers, 1) * spec.a


def _loss_working_set(model, spec: ActSpec, pp: int) -> float:
    """The fused loss's backward on the last stage (layers/loss.py): one chunk's recomputed
    logits (softmax - onehot in float32 or wider, and its compute-dtype cast), dh, and dW (under
    a 16-bit compute dtype: its float32 sum and one chunk's product beside it)."""
    Vl = -(-model.vocab_size // spec.tp)
    T, D = spec.tokens, model.dim
    chunk = min(T, chunk_tokens(Vl))
    logits = chunk * Vl * (spec.f + (spec.a if spec.a < spec.f else 0))
    dw = Vl * D * (4 + spec.a if spec.a < spec.f else spec.a)
    return logits + T * D * spec.r + dw
