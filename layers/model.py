"""A decoder-only MoE language model: embedding, blocks of (attention, dense FFN or MoE), head.

Legend: B batch (sequences), S sequence length, D model dim, H query heads, G key/value heads,
Hd head dim, V vocabulary.

Blocks are pre-norm: h = x + attn(norm(x)); out = h + ffn(norm(h)). Attention (attention.py) is
causal with rotary position embeddings (rotate-half convention, as Llama/Mixtral/Qwen) and
grouped-query heads through SDPA. A layer is MoE when its index i >= first_k_dense and
(i - first_k_dense) % moe_every == 0.
Decoding passes a KVCache (cache.py): each call runs the positions after the cached ones.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .balance import BalanceStep, MicroBalance
from .cache import KVCache, LayerCache
from .documents import Documents, build_documents
from .experts import ACTIVATIONS, FeedForward
from .init import init_weights
from .mla import MLA
from .moe import MoE
from .mtp import MTPLayer, MTPMicro, mtp_forward
from .rope import RMSNorm, YaRN, model_rotary_tables
from .router import RouterConfig, check_number

__all__ = ["ModelConfig", "Transformer", "Block", "QK_NORMS", "ROPE_SCALINGS"]

QK_NORMS = ("none", "head", "full")
ROPE_SCALINGS = ("none", "yarn")


# Upper bounds of the size fields: each well above any published model (DeepNet's 1,000 layers,
# vocabularies of 256k, dims of 16k, contexts of 1M) and below what a build could still finish.
_LARGEST = {"vocab_size": 1 << 24, "dim": 1 << 16, "num_layers": 1024, "num_heads": 1 << 12,
            "num_kv_heads": 1 << 12, "head_dim": 1 << 12, "ffn_dim": 1 << 20,
            "moe_ffn_dim": 1 << 20, "num_experts": 1 << 16, "top_k": 1 << 10,
            "first_k_dense": 1024, "moe_every": 1024, "moe_offset": 1024,
            "num_shared_experts": 1 << 10, "shared_ffn_dim": 1 << 20, "q_lora_rank": 1 << 16,
            "kv_lora_rank": 1 << 16, "qk_nope_head_dim": 1 << 12, "qk_rope_head_dim": 1 << 12,
            "v_head_dim": 1 << 12, "max_seq_len": 1 << 22, "rope_original_max_seq_len": 1 << 22,
            "mtp_layers": 64}


@dataclass
class ModelConfig:
    """Model shape; the `[model]` section of a run config."""
    vocab_size: int = 256
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0              # 0: dim // num_heads
    ffn_dim: int = 512             # hidden size of dense FFN layers
    moe_ffn_dim: int = 256         # hidden size of each routed expert
    num_experts: int = 8           # 0: no MoE layer (a dense model)
    top_k: int = 2
    first_k_dense: int = 0         # the first k layers are dense
    moe_every: int = 1             # after those, every n-th layer is MoE ...
    moe_offset: int = 0            # ... starting at this one (Qwen's decoder_sparse_step s: s-1)
    dense_layers: list[int] = field(default_factory=list)  # also dense (Qwen's mlp_only_layers)
    num_shared_experts: int = 0
    shared_ffn_dim: int = 0        # 0: moe_ffn_dim
    shared_gate: bool = False      # Qwen2-MoE sigmoid gate on the shared experts
    activation: str = "swiglu"
    attention: str = "gqa"         # "gqa" (grouped-query) or "mla" (DeepSeek latent attention)
    q_lora_rank: int = 0           # mla: q latent rank (0: a plain q projection)
    kv_lora_rank: int = 0          # mla: kv latent rank
    qk_nope_head_dim: int = 0      # mla: the part of a q/k head without RoPE
    qk_rope_head_dim: int = 0      # mla: the part with RoPE (shared by all heads for k)
    v_head_dim: int = 0            # mla: value head dim
    attention_bias: bool = False   # biases on the q, k, v projections (Qwen2-MoE)
    qk_norm: str = "none"          # RMSNorm on q and k: "head" (per head, Qwen3) or "full" (OLMoE)
    tie_embeddings: bool = False
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: str = "none"     # "none" or "yarn" (context extension; the rope_* keys below)
    rope_factor: float = 1.0       # yarn: context length / original context length
    rope_original_max_seq_len: int = 0  # yarn: the pretraining context length
    rope_beta_fast: float = 32.0   # yarn: dims turning more often than this keep their frequency
    rope_beta_slow: float = 1.0    # yarn: dims turning less often are slowed by rope_factor
    rope_mscale: float = 0.0       # yarn: cos/sin scale m(this)/m(rope_mscale_all_dim) (m: YaRN mscale)
    rope_mscale_all_dim: float = 0.0  # yarn: see rope_mscale; MLA also scales its softmax by m(this)^2
    rope_attention_factor: float = 0.0  # yarn: the cos/sin scale itself (0: from the above)
    rope_truncate: bool = True     # yarn: round the frequency ramp's ends to whole dims
    norm_eps: float = 1e-5
    init_std: float = 0.02
    mtp_layers: int = 0            # DeepSeek-V3 multi-token prediction depths (layers/mtp.py)

    def __post_init__(self):
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim",
                     "moe_ffn_dim", "top_k", "moe_every", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        # num_experts = 0: every layer dense (a dense baseline at the MoE model's active size)
        for name in ("head_dim", "first_k_dense", "num_shared_experts", "shared_ffn_dim",
                     "num_experts", "mtp_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 0")
        for name, most in _LARGEST.items():   # beyond these no build finishes (or fits)
            if getattr(self, name) > most:
                raise ValueError(f"model.{name}={getattr(self, name)} exceeds {most:,}, more "
                                 "than any model can be built with")
        if len(self.dense_layers) > self.num_layers:
            raise ValueError(f"model.dense_layers has {len(self.dense_layers)} entries, more than "
                             f"model.num_layers={self.num_layers}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation={self.activation!r} is not one of {ACTIVATIONS}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            check_number(f"model.{name}", getattr(self, name), strict=True)
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"model.qk_norm={self.qk_norm!r} is not one of {QK_NORMS}")
        if not 0 <= self.moe_offset < self.moe_every:
            raise ValueError(f"model.moe_offset={self.moe_offset} must be in [0, model.moe_every="
                             f"{self.moe_every})")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"model.dense_layers={self.dense_layers} has layers outside "
                             f"[0, model.num_layers={self.num_layers}): {bad}")
        if self.attention != "mla" and not self.head_dim and self.dim % self.num_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.num_heads="
                             f"{self.num_heads} (or set model.head_dim)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be divisible by "
                             f"model.num_kv_heads={self.num_kv_heads}")
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"model.top_k={self.top_k} must be <= model.num_experts={self.num_experts}")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"model.attention={self.attention!r} is not one of 'gqa', 'mla'")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1 with "
                                     "model.attention='mla'")
            if self.qk_norm != "none" or self.attention_bias:
                raise ValueError("model.attention='mla' takes no model.qk_norm or model.attention_bias")
        if self.rope_dim % 2:
            raise ValueError(f"rotary dim {self.rope_dim} must be even")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} is not one of {ROPE_SCALINGS}")
        if self.rope_scaling == "yarn":
            check_number("model.rope_factor", self.rope_factor, low=1.0)
            if self.rope_original_max_seq_len < 1:
                raise ValueError(f"model.rope_original_max_seq_len={self.rope_original_max_seq_len} "
                                 "must be >= 1 with model.rope_scaling='yarn'")
            for name in ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",
                         "rope_attention_factor"):
                check_number(f"model.{name}", getattr(self, name))

    @property
    def head_dim_resolved(self) -> int:
        return self.head_dim or self.dim // self.num_heads

    @property
    def rope_dim(self) -> int:
        """The dims RoPE rotates per head: the whole head, or MLA's rope part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim_resolved

    @property
    def yarn(self) -> YaRN | None:
        """The YaRN parameters, or None for plain RoPE."""
        if self.rope_scaling != "yarn":
            return None
        return YaRN(self.rope_factor, self.rope_original_max_seq_len, self.rope_beta_fast,
                    self.rope_beta_slow, self.rope_mscale, self.rope_mscale_all_dim,
                    self.rope_attention_factor, self.rope_truncate)

    @property
    def mtp_layer_ids(self) -> list[int]:
        """The model layer number of each MTP depth's block (after the main layers, as HF's)."""
        return list(range(self.num_layers, self.num_layers + self.mtp_layers))

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i >= self.first_k_dense and i not in self.dense_layers
                and (i - self.first_k_dense) % self.moe_every == self.moe_offset)


class Block(nn.Module):
    """One pre-norm decoder block; `ffn` is a FeedForward or a MoE (fixed at build time)."""

    def __init__(self, cfg: ModelConfig, router: RouterConfig, layer_id: int):
        super().__init__()
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MLA(cfg, out_std) if cfg.attention == "mla" else Attention(cfg, out_std)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        if self.is_moe:
            self.ffn = MoE(cfg.dim, cfg.moe_ffn_dim, cfg.num_experts, cfg.top_k,
                           activation=cfg.activation, num_shared_experts=cfg.num_shared_experts,
                           shared_ffn_dim=cfg.shared_ffn_dim or None, shared_gate=cfg.shared_gate,
                           router=router, aux_loss_scale=1.0, init_std=cfg.init_std,
                           out_init_std=out_std)
        else:
            self.ffn = FeedForward(cfg.dim, cfg.ffn_dim, cfg.activation, cfg.init_std, out_std)

    def forward(self, x_BSD, cos_SHd, sin_SHd, balance: MicroBalance | None = None,
                cache: LayerCache | None = None, docs: Documents | None = None):
        """Returns (x_BSD, moe_output or None). `balance`: the micro-batch's holder of a deferred
        balance loss (layers/balance.py); positional, as activation recompute passes it.
        `docs`: packed documents (layers/documents.py): attention mask, padding, documents."""
        # Only decoding passes a cache (parallel/tensor.py's sequence-parallel attention takes
        # none), only packed documents a mask; positional, as attention recompute passes them.
        extra = () if cache is None else (cache,)
        if docs is not None:
            extra = (cache, docs.mask_B1SS)
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_SHd, sin_SHd, *extra)
        if self.is_moe:
            slot = None if balance is None else balance.slot(self.layer_id)
            moe_out = self.ffn(self.ffn_norm(h_BSD), slot, *(() if docs is None else (docs,)))
            return h_BSD + moe_out.y, moe_out
        return h_BSD + self.ffn(self.ffn_norm(h_BSD)), None


class Transformer(nn.Module):
    """forward(tokens_BS) -> (logits_BSV, [MoEOutput per MoE layer, in layer order]).

    A pipeline stage is this model with the modules its rank does not hold removed
    (parallel/pipeline.py `apply_pp`): without `embed` it takes the previous stage's hidden
    states, without `norm` (and head) it returns its own, and `chunk_slices` (interleaved
    schedules) cuts its blocks into chunks, `forward(x, chunk=j)` running chunk j. Its blocks keep
    their model-wide names and ids (`layers.<id>`), so checkpoints do not depend on the split.

    MoE layers inject their aux losses into backward with scale `aux_loss_scale` (set it to the
    weight the caller gives each micro-batch's loss, e.g. 1/num_micro_batches). A balance loss
    over all MoE layers (router.balance_loss='all_layers', or the global scope) is finished at
    the end of forward, over this call's tokens, unless the caller passes its own `balance`
    holder (a step runner: it finishes it, counts over the step and dp ranks included).
    """

    def __init__(self, cfg: ModelConfig, router: RouterConfig | None = None,
                 seed: int | None = None):
        super().__init__()
        if seed is None:   # torch.manual_seed(s) before building still fixes the weights
            seed = int(torch.randint(0, 2 ** 62, ()))
        router = router or RouterConfig()
        router.check_experts(cfg.num_experts, cfg.top_k)
        self.cfg, self.router_cfg = cfg, router
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        self.layers = nn.ModuleList(Block(cfg, router, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # Multi-token prediction: with the final norm and head (a pipeline's last stage).
        self.mtp = (nn.ModuleList(MTPLayer(cfg, router, i, Block) for i in cfg.mtp_layer_ids)
                    if cfg.mtp_layers else None)
        self.head = None
        if not cfg.tie_embeddings:
            self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            nn.init.normal_(self.head.weight, std=cfg.init_std)
        # Positions of the blocks of each chunk in `layers` (a pipeline stage's); None: one chunk.
        self.chunk_slices: list[slice] | None = None
        cos, sin = self.rotary_buffers(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Built on the meta device (a sharded run), each rank draws its own shards later;
        # otherwise draw now, with the same layout-free values (layers/init.py).
        if self.embed.weight.device.type != "meta":
            init_weights(self, seed)

    rotary_buffers = staticmethod(model_rotary_tables)

    # Under sequence parallelism hidden states hold 1/seq_split of each sequence (tensor.py).
    seq_split = 1

    @property
    def layer_ids(self) -> list[int]:
        """The model layer number of each block this model holds, in order."""
        return [block.layer_id for block in self.layers]

    @property
    def num_chunks(self) -> int:
        return 1 if self.chunk_slices is None else len(self.chunk_slices)

    def blocks(self) -> list[Block]:
        """This model's decoder blocks in layer order: its layers, then the MTP depths' blocks."""
        return list(self.layers) + ([] if self.mtp is None else [m.block for m in self.mtp])

    def moe_layers(self) -> list[MoE]:
        """This model's MoE layers in layer order (the order its MoE outputs come back in)."""
        return [block.ffn for block in self.blocks() if block.is_moe]

    def moe_indices(self) -> list[int]:
        """Positions of this model's MoE layers among the whole model's (a pipeline stage holds
        some): where each one's step statistics belong."""
        cfg = self.cfg
        moe_ids = [i for i in range(cfg.num_layers + cfg.mtp_layers) if cfg.is_moe_layer(i)]
        return [moe_ids.index(block.layer_id) for block in self.blocks() if block.is_moe]

    def set_aux_loss_scale(self, scale: float):
        for moe in self.moe_layers():
            moe.aux_loss_scale = scale

    def forward(self, x, balance: MicroBalance | None = None, *, cache: KVCache | None = None,
                logits_to_keep: int = 0, chunk: int | None = None, head_fn=None,
                positions=None, documents=None, mtp: MTPMicro | None = None):
        """`x`: token ids [B, S], or the hidden states [B, S, D] a previous pipeline stage sent
        (this model holds no embedding, or runs a chunk after its first). Returns (logits, or the
        hidden states when this model or chunk does not end the model; the MoE outputs).
        `balance`: the micro-batch's holder of a deferred balance loss (None: a holder of this
        call's own when training needs one). `cache` (decoding): tokens_BS are the positions after
        the cached ones; their keys and values are added to it. Each call is one capacity group of
        its MoE layers. `logits_to_keep` > 0: logits of the last that many positions only (a
        prompt's prefill needs one row of [S, V], not all). `chunk`: run that chunk of
        `chunk_slices` only. `head_fn(h_BSD, head_weight)` replaces the LM head, and its value the
        logits: the training loss reads the final norm's output and the head weight and never
        forms the logits (parallel/loss.py). It runs inside forward, so that wrappers that gather
        parameters around forward and backward (FSDP2) see the head weight used there.
        `positions`: int64 [S] or [B, S], each token's RoPE position (inside its document or
        sequence; default start + arange(S)), each below model.max_seq_len. `documents`: int64
        [B, S] document numbers of packed rows, -1 for padding (layers/documents.py): attention
        stays within documents, positions restart at each (unless given), and the routers count
        real tokens only, the sequence balance loss per document; after a non-empty cache,
        [B, cached + S]: the cached positions' numbers too (decoding padded prompts).
        `mtp` (training with model.mtp_layers, head_fn given): this micro-batch's MTPMicro; the
        embedding output is filed in it, and the MTP depths run after the head, calling
        head_fn(h, w, k) for depth k, their losses added to it (layers/mtp.py)."""
        last_chunk = chunk is None or chunk == self.num_chunks - 1
        start = 0 if cache is None else cache.length
        if self.embed is not None and not chunk:
            if start + x.shape[1] > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {start + x.shape[1]} exceeds model.max_seq_len="
                                 f"{self.cfg.max_seq_len}")
            x = self.embed(x)
            if mtp is not None:
                mtp.embeds_BSD = x
        end = start + x.shape[1] * self.seq_split      # the rotary tables cover whole sequences
        alone = (balance is None and self.router_cfg.deferred_balance and torch.is_grad_enabled()
                 and self.chunk_slices is None)
        if alone:
            balance = MicroBalance()
        docs = None
        if documents is not None:   # (after a cache: its positions' numbers, then the new ones)
            docs = build_documents(documents, start)
            positions = docs.positions_BS if positions is None else positions
        if positions is None:
            cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        else:   # a gather of the tables' rows; per row: [B, 1, S, Hd], broadcast over heads
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            if positions.dim() == 2:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        blocks = self.layers if chunk is None else self.layers[self.chunk_slices[chunk]]
        moe_outputs = []
        for i, block in enumerate(blocks):
            x, moe_out = block(x, cos, sin, balance, None if cache is None else cache.layers[i],
                               docs)
            if moe_out is not None:
                moe_outputs.append(moe_out)
        if alone:
            BalanceStep(self.router_cfg, self.cfg.num_experts, self.cfg.top_k,
                        device=x.device).finish(balance)
        if self.norm is None or not last_chunk:
            return x, moe_outputs
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if head_fn is not None:
            h_BSD = self.final_hidden(x)
            out = head_fn(h_BSD, self.head_weight)
            if mtp is not None and self.mtp is not None:
                moe_outputs += mtp_forward(self.mtp, h_BSD, mtp.embeds_BSD, cos, sin, balance,
                                           head_fn, self.head_weight, mtp)
            return out, moe_outputs
        return self.output(x), moe_outputs

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache for up to `capacity` positions (default model.max_seq_len)."""
        capacity = capacity or self.cfg.max_seq_len
        if capacity > self.cfg.max_seq_len:
            raise ValueError(f"a cache of {capacity} positions exceeds model.max_seq_len="
                             f"{self.cfg.max_seq_len}")
        return KVCache(len(self.layers), capacity)

    @property
    def head_weight(self):
        """The LM head's weight [V, D]: the embedding's when tied."""
        return self.embed.weight if self.head is None else self.head.weight

    def final_hidden(self, x_BSD):
        """The final norm: what the head reads."""
        return self.norm(x_BSD)

    def output(self, x_BSD):
        """Final norm and LM head: hidden states -> logits."""
        return F.linear(self.final_hidden(x_BSD), self.head_weight)
