"""Autograd-aware tensor-parallel collectives over an explicit TP group (Megatron's f/g operators).

Each function takes the ``group`` and returns a tensor of the documented shape; with a group of size 1
they are identities. Source: Shoeybi et al., "Megatron-LM" (2019), section 3, operators f and g.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import collectives as C


def _size(group) -> int:
    return dist.get_world_size(group)


class _CopyToTP(torch.autograd.Function):
    """Forward identity, backward all-reduce (sum) of the input gradient: Megatron's ``f``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        if _size(ctx.group) > 1:
            g = g.contiguous()
            C.all_reduce(g, ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce (sum), backward identity: Megatron's ``g``."""

    @staticmethod
    def forward(ctx, x, group):
        if _size(group) > 1:
            x = x.contiguous()
            C.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    C.all_gather_list(parts, x.contiguous(), group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; the backward sums the gradient over the TP group. Any shape."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of the partial results over the TP group; the backward passes the gradient through."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate ``[..., n]`` shards along the last dim to ``[..., n * tp]``; backward splits."""
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's 1/tp slice of the last dim; backward all-gathers the gradient."""
    return _ScatterToTP.apply(x, group)
