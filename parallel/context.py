"""Context parallelism: every sequence split over the cp ranks, with causal load balancing.

Talks on the `cp` group (attention's keys and values) and the `cp_tp` group (the routers' token
group: every rank holding a piece of the same sequences). Legend: B batch, S sequence length,
c = S / (2 cp) one chunk, H/G query/key-value heads, d head dim, X any trailing dims.

A sequence is cut into 2*cp chunks; cp rank r holds chunks r and 2cp-1-r (one from the head,
one from the tail), so under the causal mask every rank has the same attention work. The model
takes whole token ids on every cp rank (as tp does), keeps its two chunks and their positions
(`Transformer.forward(positions=...)`, for RoPE); the loss takes the same chunks of the targets.

| region                       | forward                             | backward                      |
|------------------------------|-------------------------------------|-------------------------------|
| GQA keys and values          | all-gather along S (2G*d per token) | reduce-scatter along S (sum)  |
| MLA kv latent and key RoPE   | all-gather along S (C+R per token:  | reduce-scatter along S (sum)  |
|   part                       | 576 for DeepSeek-V3, not 40960)     |                               |
| attention                    | local: each chunk's queries over    | local                         |
|                              | the keys before it (mask-free,      |                               |
|                              | tiled: layers/blockwise.py)         |                               |
| MoE router (sequence_router) | capacity: all-gather of picks over  | none                          |
|                              | cp_tp; losses: one all-reduce       |                               |
| dense gradients              | summed over dp_cp, / dp (ddp.py, zero.py)                           |

Why not torch's `context_parallel` (torch.distributed.tensor.experimental): it patches SDPA's
flash and efficient CUDA kernels; on CPU with gloo (torch 2.13) it fails with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered", it does not see MLA's latent (it would gather the expanded keys and values), and it
takes the sequence as DTensor buffers rather than this model's positions seam.

Loss and gradients: each cp rank's loss is the mean over its own positions divided by cp, its
share of the micro-batch's mean, so gradients are *summed* over cp (as partial gradients over tp
are): dense ones over dp_cp with the data-parallel 1/dp, experts over edp (which spans cp) as
before; the reported loss and statistics are summed over dp_cp.
"""

import torch

from moepar.layers.blockwise import causal_tiled_attention
from moepar.layers.model import Transformer

from .comm import all_gather_rows, group_size
from .sequence_router import use_token_group
from .tensor import reduce_from_tp

__all__ = ["check_cp", "chunk_ids", "local_positions", "take_local", "ContextParallel",
           "ContextTokenGroup", "context_parallel_loss", "apply_cp"]


def check_cp(cp: int, tp: int, seq_len: int | None, router_type: str = "topk",
             compile: bool = False, pack: str = "", qk_clip: float = 0.0):
    """Raises ValueError naming the fields when a run cannot split its sequences over cp (pure)."""
    if cp < 1:
        raise ValueError(f"parallel.cp={cp} must be >= 1")
    if cp == 1:
        return
    if seq_len is not None and seq_len % (2 * cp * tp):
        raise ValueError(f"train.seq_len={seq_len} must be divisible by 2 * parallel.cp * "
                         f"parallel.tp = 2 * {cp} * {tp} = {2 * cp * tp} (each cp rank holds two "
                         "equal chunks of every sequence, each split over tp)")
    if router_type != "topk":
        raise ValueError(f"router.type={router_type!r} with parallel.cp={cp} is not supported "
                         "(each expert would need every rank's scores); use router.type='topk'")
    if pack and pack != "none":
        raise ValueError(f"data.pack={pack!r} with parallel.cp={cp} is not supported (document "
                         "masks are not split over cp yet); leave data.pack unset")
    if qk_clip > 0:
        raise ValueError(f"train.qk_clip={qk_clip} with parallel.cp={cp} is not supported (the "
                         "tracked logits would see the gathered keys without the causal mask)")
    if compile:
        raise ValueError(f"train.compile=true with parallel.cp={cp} is not supported (attention "
                         "gathers keys over cp inside the compiled region); set train.compile=false")


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) rank `cp_rank` holds: one from the head, one from the tail."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """int64 [S / cp]: the positions of this rank's two chunks, in the order it holds them."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device)
                      for j in chunk_ids(cp, cp_rank)])


def take_local(t_BSX, cp: int, cp_rank: int):
    """This rank's two chunks of every sequence of t (along dim 1): [B, S, ...] -> [B, S/cp, ...]."""
    c = t_BSX.shape[1] // (2 * cp)
    return torch.cat([t_BSX.narrow(1, j * c, c) for j in chunk_ids(cp, cp_rank)], dim=1)


class ContextParallel:
    """The attention seam (layers/context.py) for a rank holding two chunks of each sequence."""

    def __init__(self, group, cp: int, cp_rank: int):
        self.group, self.cp, self.cp_rank = group, cp, cp_rank
        # Gathered chunk k (rank k // 2, its first or second) -> canonical chunk index.
        held = [j for r in range(cp) for j in chunk_ids(cp, r)]
        self.gathered_of = [held.index(j) for j in range(2 * cp)]

    def gather(self, seq_dims, *tensors):
        """The whole sequence of each tensor along its seq dim (an int for all, or one each), in
        position order: all of them in one all-gather over cp (forward), one reduce-scatter of
        their gradients (backward). No host sync."""
        dims = seq_dims if isinstance(seq_dims, tuple) else (seq_dims,) * len(tensors)
        rows = [t.movedim(d, 0) for t, d in zip(tensors, dims, strict=True)]
        local = rows[0].shape[0]
        flat_SN = torch.cat([r.reshape(local, -1) for r in rows], dim=1)
        gathered_SN = all_gather_rows(flat_SN, self.group)      # rank-major chunks
        c = local // 2
        whole_SN = torch.cat([gathered_SN.narrow(0, k * c, c) for k in self.gathered_of])
        out = []
        for r, d, part in zip(rows, dims, whole_SN.split([r[0].numel() for r in rows], dim=1),
                              strict=True):
            out.append(part.reshape((self.cp * local,) + r.shape[1:]).movedim(0, d))
        return out

    def attention(self, q_BHSd, k_BGSd, v_BGSd, scale: float | None = None, mask_B1SL=None):
        """Each local chunk's queries over the keys up to its end (chunk j: (j+1)*c keys, causal
        within its own block): exact, and the same work on every rank. Mask-free and tiled
        (layers/blockwise.py): the prefix before the chunk and its diagonal block merged by
        log-sum-exp, only the output and its log-sum-exp saved for backward. Document masks are
        not split over cp (the config refuses data.pack with parallel.cp > 1)."""
        if mask_B1SL is not None:
            raise ValueError("packed documents (data.pack) with parallel.cp > 1 are not supported")
        c = q_BHSd.shape[2] // 2
        outs = []
        for half, j in enumerate(chunk_ids(self.cp, self.cp_rank)):
            keys = (j + 1) * c
            outs.append(causal_tiled_attention(
                q_BHSd.narrow(2, half * c, c), k_BGSd.narrow(2, 0, keys),
                v_BGSd.narrow(2, 0, keys), j * c, scale))
        return torch.cat(outs, dim=2)


class ContextTokenGroup:
    """The routers' view of the cp x tp ranks of a sequence (sequence_router.py): rank g = cp_rank
    * tp + tp_rank of `group` holds s = S/(cp*tp) positions, slice tp_rank of its two chunks.

    gather: [B, s, X] -> [B, S, X] in position order (no gradient: capacity decisions); local: the
    inverse; total: all-reduce sum forward, gradient passed straight back."""

    def __init__(self, group, cp: int, cp_rank: int, tp: int, tp_rank: int):
        self.group, self.size = group, group_size(group)
        self.cp, self.tp, self.me = cp, tp, cp_rank * tp + tp_rank
        self._index = {}

    def _positions(self, s: int, device):
        """(position of every gathered row [S], this rank's positions [s]), cached per s."""
        key = (s, str(device))
        if key not in self._index:
            seq = s * self.size
            held = torch.cat([local_positions(seq, self.cp, g // self.tp, device)
                              .narrow(0, (g % self.tp) * s, s) for g in range(self.size)])
            self._index[key] = (torch.argsort(held), held.narrow(0, self.me * s, s))
        return self._index[key]

    def gather(self, t_BsX):
        order, _ = self._positions(t_BsX.shape[1], t_BsX.device)
        with torch.no_grad():
            rows = all_gather_rows(t_BsX.transpose(0, 1).contiguous(), self.group)
            return rows.index_select(0, order).transpose(0, 1)

    def local(self, t_BSX):
        _, mine = self._positions(t_BSX.shape[1] // self.size, t_BSX.device)
        return t_BSX.index_select(1, mine)

    def total(self, t):
        return reduce_from_tp(t, self.group)


class ContextParallelModel:
    """Put before a model's class (Transformer, TensorParallelTransformer): forward takes whole
    token ids [B, S] (or this rank's hidden states from a previous pipeline stage) and runs this
    rank's two chunks of each sequence at their own positions."""

    cp_size, cp_rank = 1, 0

    @property
    def seq_split(self) -> int:
        return self.cp_size * super().seq_split

    def forward(self, x, balance=None, **kwargs):
        if not x.is_floating_point():      # token ids, whole sequences
            seq = x.shape[1]
            if seq % (2 * self.cp_size * super().seq_split):
                raise ValueError(f"sequence length {seq} must be divisible by 2 * parallel.cp * "
                                 f"parallel.tp = {2 * self.seq_split} (context parallelism)")
            if seq > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds model.max_seq_len="
                                 f"{self.cfg.max_seq_len}")
            x = take_local(x, self.cp_size, self.cp_rank)
        else:
            seq = x.shape[1] * self.seq_split
        positions = local_positions(seq, self.cp_size, self.cp_rank, x.device)
        return super().forward(x, balance, positions=positions, **kwargs)


_CLASSES: dict[type, type] = {}


def _context_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ContextParallel{cls.__name__}", (ContextParallelModel, cls), {})
    return _CLASSES[cls]


def context_parallel_loss(loss_fn, cp: int, cp_rank: int):
    """loss(h, head weight, whole targets [B, S], grad_scale=None) of this rank's chunks: the mean
    over its positions / cp, its share of the micro-batch's mean (summed over cp by the gradient
    sync)."""
    if cp == 1:
        return loss_fn

    def loss(h_BsD, w_VD, targets_BS, grad_scale=None):
        # The runner backpropagates grad_scale into this value, so grad_scale / cp into the
        # inner loss, which forms its head gradients in forward from the scale it is told.
        inner = None if grad_scale is None else grad_scale / cp
        return loss_fn(h_BsD, w_VD, take_local(targets_BS, cp, cp_rank), grad_scale=inner) / cp
    return loss


@torch.no_grad()
def apply_cp(model: Transformer, dims, meshes, seq_len: int | None = None) -> Transformer:
    """Splits `model`'s sequences over cp in place (after tp; no parameter changes); returns it."""
    cp, tp = dims.cp, dims.tp
    check_cp(cp, tp, seq_len, model.router_cfg.type)
    cp_rank = meshes.dense.get_local_rank("cp")
    context = ContextParallel(meshes.group("cp"), cp, cp_rank)
    for block in model.layers:
        block.attn.context = context
    model.__class__ = _context_class(type(model))
    model.cp_size, model.cp_rank = cp, cp_rank
    token_group = ContextTokenGroup(meshes.group("cp_tp"), cp, cp_rank, tp,
                                    meshes.dense.get_local_rank("tp"))
    for moe in model.moe_layers():
        use_token_group(moe.router, token_group)
    return model
