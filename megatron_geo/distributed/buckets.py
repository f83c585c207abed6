"""Contiguous gradient and parameter buffers, split into buckets.

Parameters are grouped in reverse registration order (roughly the order backward produces their
gradients) into buckets of at least ``bucket_size`` elements, laid out over the DP ranks by
:func:`~megatron_geo.distributed.shard_plan.plan_model` (even chunks, or whole-parameter ownership with
uneven ranges when some parameters must be owned whole). Each bucket owns

- ``grad_data``: FP32 ``[plan.buffer_numel]`` (the parameters plus alignment padding); ``param.main_grad``
  is a view into it (gradients are accumulated here in FP32 across micro-batches);
- ``param_data``: model dtype ``[plan.buffer_numel]``; ``param.data`` is re-pointed to a view into it,
  so the gather of updated ranges writes the model parameters in place;
- ``reduction``: what the gradient reducer registered for it (:func:`register_buckets`), which the gradient sync
  hands to the reducer's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..comm.reducer import BucketReduction, GradientReducer
from .plan_types import ADAMW_FLOPS_PER_ELEMENT, ParamSpec, ShardPlan
from .shard_plan import plan_model


@dataclass
class Bucket:
    """One bucket: its parameters (with names), layout and buffers, and the reducer's registered state for it
    (``reduction``: ``None`` until :func:`register_buckets`)."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    plan: ShardPlan
    grad_data: torch.Tensor
    param_data: torch.Tensor
    reduction: BucketReduction | None = None

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def default_flops(p: nn.Parameter) -> float:
    """Optimizer FLOPs per step of an element-wise (AdamW) update of ``p``."""
    return ADAMW_FLOPS_PER_ELEMENT * p.numel()


def build_buckets(
    named_params: list[tuple[str, nn.Parameter]],
    bucket_size: int,
    dp_size: int,
    atomic_fn,
    align: int = 1,
    flops_fn=default_flops,
    granule_fn=None,
    spec_fn=None,
) -> list[Bucket]:
    """Group parameters into buckets and move them into contiguous buffers.

    Args:
        named_params: ``(name, parameter)`` in registration order; all on one device and dtype.
        bucket_size: minimum elements per bucket (the last bucket of each kind may be smaller).
        dp_size: data-parallel size.
        atomic_fn: ``param -> bool``, True if the parameter must be owned whole by one DP rank.
        align: every rank's range is a multiple of this many elements.
        flops_fn: ``param -> float``, optimizer FLOPs per step of owning ``param`` (balances ownership).
        granule_fn: ``param -> int``, a non-atomic parameter is cut only at multiples of this many elements
            (default 1: anywhere).
        spec_fn: ``param -> ParamSpec``, the planner's whole view of ``param`` (with a Muon matrix's shape and split
            rule, see :mod:`.split_plan`); when given, the three functions above are not used.
    """
    group = [(n, p) for n, p in reversed(named_params) if p.requires_grad]
    specs = [
        spec_fn(p)
        if spec_fn is not None
        else ParamSpec(p.numel(), bool(atomic_fn(p)), float(flops_fn(p)), int(granule_fn(p)) if granule_fn else 1)
        for _, p in group
    ]
    buckets = []
    for bi, (idx, plan) in enumerate(plan_model(specs, bucket_size, dp_size, align)):
        params = [group[i][1] for i in idx]
        dev, dtype = params[0].device, params[0].dtype
        grad_data = torch.zeros(plan.buffer_numel, dtype=torch.float32, device=dev)
        param_data = torch.zeros(plan.buffer_numel, dtype=dtype, device=dev)
        for p, off in zip(params, plan.offsets):
            n = p.numel()
            view = param_data[off : off + n].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.main_grad = grad_data[off : off + n].view_as(p)  # type: ignore[attr-defined]
        buckets.append(Bucket(bi, params, [group[i][0] for i in idx], plan, grad_data, param_data))
    return buckets


def register_buckets(reducer: GradientReducer, buckets: list[Bucket], device) -> None:
    """Register every bucket's layout with ``reducer`` under its ``index`` (parameter offsets and sizes, the plan's
    owner ranges; ``device``: a ``torch.device`` or its name) and keep what it returns as ``bucket.reduction``."""
    for b in buckets:
        b.reduction = reducer.register_bucket(
            b.index, b.plan.offsets, [p.numel() for p in b.params], b.plan.bounds, device
        )
