"""The ownership rule: what the shard planner may do with each parameter, decided once for the trainer's buckets
and for the plan report.

For every parameter that needs a gradient, :func:`param_specs` decides

- *atomic*: owned whole by one DP rank. Muon matrices under the distributed optimizer (Newton-Schulz
  orthogonalises whole matrices);
- *granule*: a splittable parameter is cut only at multiples of this many elements from its start. GeoFP8
  layers (``comm.transform=geo``) under the distributed optimizer keep whole rows on their owner (``G T`` mixes
  columns only and each row is inverted on its own), cut at a multiple of the reducer's alignment as well;
  every other parameter 1 (anywhere; the planner rounds cuts to the alignment);
- *optimizer FLOPs* per step of owning it: :func:`~.plan_types.newton_schulz_flops` for Muon matrices (of
  ``optimizer.muon_ns``'s form: quintic, or Gram Newton-Schulz for rectangular matrices),
  :data:`~.plan_types.ADAMW_FLOPS_PER_ELEMENT` per element otherwise (element-wise AdamW / Muon's AdamW group);
- *split*: a Muon matrix under the distributed optimizer carries its shape and ``optimizer.muon_split``, so the
  planner may split it by rows over a small group of DP ranks where owning it whole cannot balance
  (:mod:`.split_plan`).

Without the distributed optimizer every rank owns everything, so nothing is atomic and nothing granular.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from ..optim.muon import newton_schulz_dtype
from .plan_types import ADAMW_FLOPS_PER_ELEMENT, ParamSpec, newton_schulz_flops
from .split_plan import parse_muon_split

ParamInfo = tuple[str, tuple[int, ...], bool]
"""``(name, local shape, use_muon)`` of one parameter (``use_muon``: Muon's orthogonalised group)."""


def param_specs(
    cfg, names_shapes: Sequence[ParamInfo], alignment: int, geo_layers: Collection[str] = ()
) -> list[ParamSpec]:
    """The planner's view of every parameter, in the order of ``names_shapes``.

    Args:
        cfg: the run's :class:`~megatron_geo.config.Config` (reads ``optimizer.name``, ``optimizer.muon_ns``,
            ``optimizer.muon_ns_dtype``, ``optimizer.muon_split`` and ``parallel.distributed_optimizer``).
        names_shapes: ``(name, local shape, use_muon)`` of each parameter that needs a gradient.
        alignment: the reducer's alignment in elements (``comm_alignment(cfg.comm)``, >= 1): every rank's range
            and every parameter start is a multiple of it.
        geo_layers: names of the GeoFP8 layers (``geometry.select_parameters`` of ``geo.layers``; empty unless
            ``comm.transform=geo``).

    Returns:
        One :class:`~.plan_types.ParamSpec` per entry: ``numel``, ``atomic``, ``flops`` (FLOPs per step),
        ``granule`` (elements).

    Raises:
        ValueError: ``alignment`` below 1.
        ConfigError: ``optimizer.muon_split`` is not ``auto``, ``off`` or a group size >= 2
            (:func:`~.split_plan.parse_muon_split`), or ``optimizer.muon_ns_dtype`` is unknown (Muon under the
            distributed optimizer).
    """
    if alignment < 1:
        raise ValueError(f"alignment={alignment} must be >= 1")
    muon = cfg.optimizer.name == "muon"
    sharded = cfg.parallel.distributed_optimizer
    ns = cfg.optimizer.muon_ns
    split = cfg.optimizer.muon_split  # carried as written; the planner reads it with parse_muon_split
    if muon:
        parse_muon_split(split)  # a bad value is an error before any plan
    # the plan is for GPUs (identical on every rank whatever it runs on): the iteration's dtype there
    ns_bytes = newton_schulz_dtype(cfg.optimizer, "cuda").itemsize if muon and sharded else 2
    specs = []
    for name, shape, use_muon in names_shapes:
        numel = math.prod(shape)
        matrix = muon and use_muon
        flops = newton_schulz_flops(tuple(shape), ns=ns) if matrix else ADAMW_FLOPS_PER_ELEMENT * numel
        row = shape[1] if sharded and name in geo_layers else 1
        spec = ParamSpec(numel, sharded and matrix, float(flops), math.lcm(row, alignment) if row > 1 else 1)
        if sharded and matrix and len(shape) == 2:
            spec.rows, spec.cols, spec.ns, spec.split, spec.ns_bytes = shape[0], shape[1], ns, split, ns_bytes
        specs.append(spec)
    return specs


def param_infos(model) -> list[ParamInfo]:
    """``(name, shape, use_muon)`` of every parameter of ``model`` (an ``nn.Module``, any device, ``meta``
    included) that needs a gradient, in registration order."""
    return [
        (n, tuple(p.shape), bool(getattr(p, "use_muon", False))) for n, p in model.named_parameters() if p.requires_grad
    ]
