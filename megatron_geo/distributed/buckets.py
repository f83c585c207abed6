"""Contiguous gradient and parameter buffers, split into buckets.

Parameters are grouped in reverse registration order (roughly the order backward produces their
gradients) into buckets of at least ``bucket_size`` elements. Each bucket owns

- ``grad_data``: FP32 ``[dp_size * chunk]``; ``param.main_grad`` is a view into it (gradients are
  accumulated here in FP32 across micro-batches);
- ``param_data``: model dtype ``[dp_size * chunk]``; ``param.data`` is re-pointed to a view into it,
  so the all-gather of updated shards writes the model parameters in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .shard_plan import ShardPlan, plan_shards


@dataclass
class Bucket:
    """One bucket: its parameters (with names), layout and buffers."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    plan: ShardPlan
    grad_data: torch.Tensor
    param_data: torch.Tensor

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def build_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_size: int, dp_size: int,
                  atomic_fn, align: int = 1) -> list[Bucket]:
    """Group parameters into buckets and move them into contiguous buffers.

    Args:
        named_params: ``(name, parameter)`` in registration order; all on one device and dtype.
        bucket_size: minimum elements per bucket (the last bucket may be smaller).
        dp_size: data-parallel size (number of chunks per bucket).
        atomic_fn: ``param -> bool``, True if the parameter must be owned whole by one DP rank.
        align: chunk alignment in elements.
    """
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    count = 0
    for name, p in reversed(named_params):
        if not p.requires_grad:
            continue
        groups[-1].append((name, p))
        count += p.numel()
        if count >= bucket_size:
            groups.append([])
            count = 0
    groups = [g for g in groups if g]
    buckets = []
    for bi, group in enumerate(groups):
        params = [p for _, p in group]
        numels = [p.numel() for p in params]
        plan = plan_shards(numels, [bool(atomic_fn(p)) for p in params], dp_size, align)
        dev, dtype = params[0].device, params[0].dtype
        grad_data = torch.zeros(plan.buffer_numel, dtype=torch.float32, device=dev)
        param_data = torch.zeros(plan.buffer_numel, dtype=dtype, device=dev)
        for p, off in zip(params, plan.offsets):
            n = p.numel()
            view = param_data[off:off + n].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.main_grad = grad_data[off:off + n].view_as(p)
        buckets.append(Bucket(bi, params, [n for n, _ in group], plan, grad_data, param_data))
    return buckets
