"""Llama built from tensor-parallel layers: RMSNorm, RoPE, grouped-query attention (SDPA), SwiGLU, no biases.

Init follows torchtitan's Llama: embedding N(0, 1); linear weights truncated normal (std
``init_std`` = 0.02, cut at 2 std); the projections that write into the residual stream (attention
output and MLP down) use the depth-scaled std ``init_std / sqrt(2 * num_layers)``; the output layer
uses std ``hidden_size ** -0.5`` cut at 3 std. Every weight is drawn in full from a generator seeded
by (seed, parameter name), so the model is the same for every TP size and construction order.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..config.errors import ConfigError
from ..config.schema import ModelConfig, TrainConfig
from ..tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Round the vocab up to a multiple of ``divisible_by * tp_size`` (Megatron's rule)."""
    m = divisible_by * tp_size
    return (vocab_size + m - 1) // m * m


def _init(seed: int, name: str, kind: str, std: float):
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))

    def fn(t: torch.Tensor) -> None:
        if kind == "normal":
            t.normal_(0.0, std, generator=gen)
        else:
            cut = 3.0 if kind == "trunc3" else 2.0
            nn.init.trunc_normal_(t, 0.0, std, -cut * std, cut * std, generator=gen)

    return fn


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables ``[seq_len, head_dim / 2]`` float32 (Su et al., RoFormer, eq. 34)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of ``x`` ``[b, heads, s, head_dim]`` by position-dependent angles.

    ``cos``/``sin``: the tables ``[>= s, head_dim / 2]`` (positions 0..s-1), or per-token angles
    ``[b, 1, s, head_dim / 2]`` gathered at explicit position ids (see :func:`rope_at`)."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    c, s = (cos[: x.shape[-2]], sin[: x.shape[-2]]) if cos.ndim == 2 else (cos, sin)
    out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    return out.type_as(x)


def rope_at(cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables ``[seq_length, head_dim / 2]`` gathered at ``position_ids`` int64 ``[b, s]``: ``[b, 1, s, head_dim /
    2]`` each (one head axis to broadcast over), for positions that restart per document."""
    return cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)


def document_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """SDPA boolean mask ``[b, 1, s, s]`` (True: may attend) from ``segment_ids`` int64 ``[b, s]``: causal and only
    within equal segment ids, i.e. no attention across an end-of-document token (Megatron-LM's
    ``reset_attention_mask``, which zeroes ``mask[i + 1:, :i + 1]`` for each end-of-document position ``i``)."""
    s = segment_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


class Attention(nn.Module):
    """Causal grouped-query self-attention; q/k/v column-parallel (heads split over TP), output row-parallel."""

    def __init__(self, cfg: ModelConfig, group, seed: int, prefix: str, dtype, device):
        super().__init__()
        tp = dist.get_world_size(group)
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.n_heads = cfg.num_attention_heads // tp
        self.n_kv = cfg.num_kv_heads // tp
        h, hd = cfg.hidden_size, self.head_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        col = partial(ColumnParallelLinear, group=group, dtype=dtype, device=device)
        self.q_proj = col(h, cfg.num_attention_heads * hd, init_fn=_init(seed, prefix + "q_proj", "trunc", std))
        self.k_proj = col(h, cfg.num_kv_heads * hd, init_fn=_init(seed, prefix + "k_proj", "trunc", std))
        self.v_proj = col(h, cfg.num_kv_heads * hd, init_fn=_init(seed, prefix + "v_proj", "trunc", std))
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * hd, h, group, _init(seed, prefix + "o_proj", "trunc", out_std), dtype, device
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv != self.n_heads
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # per-document causal mask (data.reset_attention_mask)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel (Shazeer 2020, eq. 6)."""

    def __init__(self, cfg: ModelConfig, group, seed: int, prefix: str, dtype, device):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.gate_proj = ColumnParallelLinear(
            h, f, group, _init(seed, prefix + "gate_proj", "trunc", std), dtype=dtype, device=device
        )
        self.up_proj = ColumnParallelLinear(
            h, f, group, _init(seed, prefix + "up_proj", "trunc", std), dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(
            f, h, group, _init(seed, prefix + "down_proj", "trunc", out_std), dtype, device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, group, seed: int, idx: int, dtype, device):
        super().__init__()
        p = f"layers.{idx}."
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, group, seed, p + "attn.", dtype, device)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype, device=device)
        self.mlp = SwiGLU(cfg, group, seed, p + "mlp.", dtype, device)

    def forward(self, x, cos, sin, attn_mask=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask)
        return x + self.mlp(self.mlp_norm(x))


def param_dtype(train: TrainConfig) -> torch.dtype:
    """``train.param_dtype`` (``fp32`` or ``bf16``) as the torch dtype the model's parameters are built in: the one
    reader of the setting (validation, the trainer's model and the plan report's meta model call it).

    Args:
        train: the ``train`` section (:class:`~megatron_geo.config.schema.TrainConfig`).

    Raises:
        ConfigError: any other value, naming the key and the choices.
    """
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if train.param_dtype not in dtypes:
        raise ConfigError(
            f"train.param_dtype={train.param_dtype!r} is not supported; choose one of {', '.join(dtypes)}"
        )
    return dtypes[train.param_dtype]


class Llama(nn.Module):
    """Decoder-only Llama over a TP group.

    Forward: ``tokens`` int64 ``[b, s]`` (s <= ``seq_length``), ``labels`` int64 ``[b, s]`` ->
    per-token loss float32 ``[b, s]`` (nats), identical on all TP ranks. Optional ``position_ids`` int64 ``[b, s]``
    (RoPE positions, e.g. restarting per document; default 0..s-1) and ``segment_ids`` int64 ``[b, s]`` (attention
    only within equal ids, causally: :func:`document_causal_mask`; default plain causal).
    """

    def __init__(self, cfg: ModelConfig, tp_group, seed: int, dtype=torch.float32, device=None):
        super().__init__()
        self._block_pre_forward: OrderedDict[int, Callable[[int, nn.Module], None]] = OrderedDict()
        self.cfg, self.tp_group = cfg, tp_group
        tp = dist.get_world_size(tp_group)
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
        self.embed = VocabParallelEmbedding(
            self.padded_vocab,
            cfg.hidden_size,
            tp_group,
            _init(seed, "embed", "normal", 1.0),
            dtype,
            device,
            vocab_size=cfg.vocab_size,
        )
        self.layers = nn.ModuleList(Block(cfg, tp_group, seed, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype, device=device)
        self.output = ColumnParallelLinear(
            cfg.hidden_size,
            self.padded_vocab,
            tp_group,
            _init(seed, "output", "trunc3", cfg.hidden_size**-0.5),
            dtype=dtype,
            device=device,
            valid_out_features=cfg.vocab_size,
        )
        cos, sin = rope_tables(cfg.seq_length, cfg.hidden_size // cfg.num_attention_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        for name, p in self.named_parameters():
            # Muon: 2-D hidden matrices inside the blocks; AdamW: embedding, output, norms.
            p.use_muon = p.ndim == 2 and name.startswith("layers.")
            if not hasattr(p, "tensor_model_parallel"):
                p.tensor_model_parallel = False
        if cfg.transformer_impl == "transformer_engine":  # the local path never imports TE
            from .te import use_transformer_engine

            use_transformer_engine(self)

    def register_block_pre_forward(self, fn: Callable[[int, nn.Module], None]) -> RemovableHandle:
        """Call ``fn(index, block)`` in :meth:`forward` just before each block of ``layers`` runs, outside the
        block's own call: eagerly even when the block is compiled in place (``train.compile=true``), where a
        module hook on the block or inside it would be traced into its graph. Callbacks run in registration
        order; ``handle.remove()`` unregisters. Blocks called directly (not through :meth:`forward`) skip them."""
        handle = RemovableHandle(self._block_pre_forward)
        self._block_pre_forward[handle.id] = fn
        return handle

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if tokens.shape[-1] > self.cfg.seq_length:
            raise ValueError(f"sequence of {tokens.shape[-1]} tokens exceeds model.seq_length={self.cfg.seq_length}")
        cos, sin = self.rope_cos, self.rope_sin
        if position_ids is not None:
            cos, sin = rope_at(cos, sin, position_ids)
        mask = document_causal_mask(segment_ids) if segment_ids is not None else None
        x = self.embed(tokens)
        for i, block in enumerate(self.layers):
            for fn in self._block_pre_forward.values():
                fn(i, block)
            x = block(x, cos, sin) if mask is None else block(x, cos, sin, mask)
        logits = self.output(self.norm(x))
        return vocab_parallel_cross_entropy(logits, labels, self.cfg.vocab_size, self.tp_group)


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the full (unsharded) model with the vocab padded for TP=1."""
    h, f, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    hd = h // cfg.num_attention_heads
    v = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, 1)
    attn = h * cfg.num_attention_heads * hd * 2 + h * cfg.num_kv_heads * hd * 2
    return L * (attn + 3 * h * f + 2 * h) + 2 * v * h + h


FLOPS_CONVENTION = (
    "Megatron-LM / PaLM: 6 x GEMM weights + 12 L s h FLOPs per token (the full attention square, no recomputation)"
)
"""One line naming :func:`flops_per_token`'s convention, for reports that print an MFU."""


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token in Megatron-LM's convention, the one every MFU of this repository uses.

    ``6 W + 12 L s q``: ``W`` the GEMM weights (every linear of the layers and the output layer; not the embedding
    lookup, not the norms), 2 FLOPs per weight and token forward and 4 backward; ``12 L s q`` the attention scores
    and values (``q`` = heads x head_dim) over the full ``s x s`` square, forward and backward, with no causal
    halving and no activation recomputation. Sources: Narayanan et al. 2021 (arXiv 2104.04473), appendix
    "Floating-point operations", as implemented by Megatron-LM's ``num_floating_point_operations``
    (megatron/training/training.py); PaLM (Chowdhery et al. 2022), appendix B, counts the same ``6 N + 12 L H Q T``.
    Units: FLOPs per token.
    """
    h, f, L, s = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers, cfg.seq_length
    hd = h // cfg.num_attention_heads
    q = cfg.num_attention_heads * hd  # query projection width
    v = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, 1)
    gemm = L * (2 * h * q + 2 * h * cfg.num_kv_heads * hd + 3 * h * f) + v * h  # q, o, k, v, MLP; output layer
    return 6.0 * gemm + 12.0 * L * s * q
