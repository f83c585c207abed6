"""Megatron-style tensor-parallel layers (no biases, as in Llama).

Every layer builds its *full* weight on the CPU from ``init_fn`` and keeps its TP slice, so a model
initialised with the same seed is identical for every TP size (the TP=2 vs TP=1 test relies on it).
Sharded weights carry ``tensor_model_parallel=True`` and ``partition_dim``; the gradient-norm code uses
it to count every parameter once over TP x DP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp

InitFn = Callable[[torch.Tensor], None]


def _local_matmul(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x W^T`` with the layer's own weight shard: F.linear, or a Transformer Engine Linear sharing the same
    weight Parameter when :func:`megatron_geo.model.te.use_transformer_engine` attached one (``te_linear``,
    kept out of the module tree so parameter names and state dicts do not change)."""
    te = layer.__dict__.get("te_linear")
    return F.linear(x, layer.weight) if te is None else te(x)


def _sharded_param(
    full_shape: tuple[int, int], dim: int, group, init_fn: InitFn, dtype, device, valid_rows: int | None = None
) -> nn.Parameter:
    if device is not None and torch.device(device).type == "meta":  # shapes only (plans, memory accounting)
        full = torch.empty(full_shape, dtype=torch.float32, device="meta")
    else:
        full = torch.zeros(full_shape, dtype=torch.float32, device="cpu")
        # Rows beyond ``valid_rows`` (vocab padding) stay zero, so the real rows do not depend on the padding.
        init_fn(full[:valid_rows] if valid_rows is not None else full)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if full_shape[dim] % n:
        raise ValueError(f"dimension {dim} of a weight of shape {full_shape} is not divisible by TP size {n}")
    shard = full.chunk(n, dim=dim)[r].contiguous().to(device=device, dtype=dtype)
    p = nn.Parameter(shard)
    p.tensor_model_parallel = n > 1
    p.partition_dim = dim
    return p


class ColumnParallelLinear(nn.Module):
    """Y = X W^T with W split along its output dim: weight ``[out_features / tp, in_features]``.

    Input ``[..., in_features]`` (replicated over TP); output ``[..., out_features / tp]``, or the full
    ``[..., out_features]`` with ``gather_output=True``. ``is_linear``: its weight's gradient is ``G = dY^T X``, so
    GeoFP8 may send it in input-side coordinates (``geometry.select_parameters``).
    """

    is_linear = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group,
        init_fn: InitFn,
        gather_output: bool = False,
        dtype=torch.float32,
        device=None,
        valid_out_features: int | None = None,
    ):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.weight = _sharded_param((out_features, in_features), 0, group, init_fn, dtype, device, valid_out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _local_matmul(self, copy_to_tp(x, self.group))
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X W^T with W split along its input dim: weight ``[out_features, in_features / tp]``.

    Input ``[..., in_features / tp]`` (already split, e.g. a column-parallel output); output
    ``[..., out_features]`` summed over the TP group. ``is_linear`` as :class:`ColumnParallelLinear`.
    """

    is_linear = True

    def __init__(self, in_features: int, out_features: int, group, init_fn: InitFn, dtype=torch.float32, device=None):
        super().__init__()
        self.group = group
        self.weight = _sharded_param((out_features, in_features), 1, group, init_fn, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(_local_matmul(self, x), self.group)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose ``[padded_vocab, dim]`` table is split along the vocab over TP.

    Input: int64 token ids of any shape, values in ``[0, padded_vocab)``. Output: ``[..., dim]``.
    Each rank looks up the ids in its vocab range, zeroes the rest, and the results are summed over TP.
    Rows ``vocab_size .. padded_vocab - 1`` (padding) are initialised to zero.
    """

    def __init__(
        self,
        padded_vocab: int,
        dim: int,
        group,
        init_fn: InitFn,
        dtype=torch.float32,
        device=None,
        vocab_size: int | None = None,
    ):
        super().__init__()
        self.group = group
        self.weight = _sharded_param((padded_vocab, dim), 0, group, init_fn, dtype, device, vocab_size)
        per = padded_vocab // dist.get_world_size(group)
        self.vocab_start = dist.get_rank(group) * per
        self.vocab_end = self.vocab_start + per

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if dist.get_world_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)
