"""`moepar plan --explain`: the rules the planner applies, and this model's numbers behind them.
The same text is the strategy guide in the README."""

from moepar.layers.shapes import param_count

__all__ = ["RULES", "explain"]

RULES = """\
How moepar plan chooses (each rule is a constraint of the search or a cost in its model):

1. TP inside a node. Tensor parallelism all-gathers and reduce-scatters the hidden states
   around every attention and dense FFN, in forward and again in backward, on the critical
   path of every micro-batch: only NVLink makes that cheap. The planner tries tp only over the
   divisors of --gpus-per-node. tp divides attention, dense FFN, embedding and LM head weights
   and the attention activations; MoE layers run on 1/tp of the sequence.
2. EP over the data-parallel ranks. Experts fold over the dp x tp ranks of a pipeline stage
   (ep divides dp * tp), so ep costs no GPUs of its own: it divides the expert parameters,
   gradients and AdamW state by ep and adds four all-to-alls of the routed rows per MoE layer
   (six under full recompute). ep is innermost in rank order, so an ep group up to the node
   size stays on NVLink; a larger one sends its off-node share at network speed. Dropless
   routing runs at the pace of the busiest EP rank (the imbalance factor); capacity routing
   caps it at the capacity factor. ep = 1 has neither cost but holds every expert.
3. PP across nodes. A stage boundary carries one hidden state per micro-batch each way, the
   cheapest traffic there is, so pipeline stages are what should cross the slow links. The
   price is the bubble, (p-1)/(v*m + p-1) of the step with m micro-batches and v virtual
   stages, and memory: 1F1B keeps p - r micro-batches in flight on pipeline rank r (the first
   rank holds the most), interleaving keeps more. Layouts whose bubble exceeds --max-bubble
   are rejected.
4. ZeRO when optimizer state dominates. moepar keeps float32 masters: 4 bytes of masters, 4 of
   gradients and 8 of AdamW state per element (bfloat16 training adds 2 of compute weights,
   unless ZeRO-3 gathers them per block). ZeRO-1
   shards the state over dp (dense) and edp (experts) for one all-gather of the parameters per
   step; ZeRO-2 also shards the gradients between steps (a reduce-scatter every micro-batch,
   with at most three buckets' flat gradient copies in flight); ZeRO-3 shards the parameters too,
   all-gathering them in every forward and backward and accumulating unsharded gradients over
   the micro-batches of a step.
5. Recompute trades compute for activations: full recompute keeps each block's input only and
   adds one forward (about a third more compute); "attention" and "experts" rebuild only those
   regions (train.recompute).
6. Under bfloat16 training the compute weights are bf16 copies of the masters, written once
   per optimizer step and kept (2 bytes per element, in every micro-batch's forward and
   backward: none is cast per micro-batch); ZeRO-3 gathers them in bf16 per block instead and
   frees them after use. The residual stream, and so the activations, are bf16 unless
   train.fp32_residual keeps them float32.
7. Among the layouts that fit, the fastest step wins; ties go to less memory."""


def explain(req, plans: list) -> list[str]:
    """RULES, then what they mean for this model on this cluster."""
    model = req.base.model
    counts = param_count(model)
    lines = RULES.splitlines() + ["", f"For this model on {req.world} x {req.gpu.name}:"]
    lines.append(f"  {counts['total'] / 1e9:.2f}B parameters ({counts['expert'] / 1e9:.2f}B in "
                 f"experts, {100 * counts['expert'] / counts['total']:.0f}%), "
                 f"{counts['active'] / 1e9:.2f}B active per token")
    lines.append(f"  unsharded: {16 * counts['total'] / 2 ** 30:.0f} GiB of parameters, gradients "
                 "and AdamW state; half of it is AdamW state, which ZeRO-1 shards over the data "
                 "ranks")
    node = min(req.gpus_per_node, req.world)
    tps = [t for t in range(1, node + 1) if node % t == 0 and model.num_heads % t == 0]
    lines.append(f"  tp within a node of {node}: {', '.join(map(str, tps))} (heads "
                 f"{model.num_heads} split evenly)")
    eps = [e for e in range(1, model.num_experts + 1) if model.num_experts % e == 0]
    lines.append(f"  ep dividing {model.num_experts} experts: {', '.join(map(str, eps))}; "
                 f"all-to-all stays on NVLink up to ep {node}")
    fitting = [p for p in plans if p.fits]
    if fitting:
        best = fitting[0].layout
        lines.append(f"  fastest: {best.describe()}, {best.schedule}, micro-batch "
                     f"{best.micro_batch}, recompute {best.recompute}")
    return lines
