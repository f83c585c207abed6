"""Live quantization error (``comm.telemetry_interval``): every N steps each rank measures, inside the reduction,
the relative round-trip error ``||decode(encode(g)) - g|| / ||g||`` of its own gradient ``g`` per
low-precision bucket, and for each GeoFP8-selected layer both through the active (geometry-aware) codec and
through the plain Euclidean codec (:meth:`megatron_geo.comm.lowp.LowPrecisionReducer._measure`). The per-rank
errors are averaged over the DP group with one all-reduce of a few floats and logged as

- ``comm/rel_err/bucket<i>``: bucket i through the active codec (transform included, error in the gradient's
  own coordinates);
- ``comm/rel_err/geo/<layer>`` and ``comm/rel_err/euclid/<layer>``: a GeoFP8 layer through its transform + codec,
  and through the codec alone (below 1 x the Euclidean figure means the geometry helps on this gradient).

Round to nearest with this rank's own scales, no error feedback: the error one encode adds, not the error of
the reduced average.

With ``comm.reduce_op=wire_sum`` (codes summed in FP8 inside the collective, :mod:`megatron_geo.comm.wire_sum`)
the same steps also log the bound hits, DP-averaged fractions:

- ``comm/bound_hits/flushed/bucket<i>``: non-zero gradient elements whose FP8 code is zero (pre-division by N
  makes these grow);
- ``comm/bound_hits/saturated/bucket<i>``: elements of the owned range whose partial sum reached the format's
  max at some hop of the ring (exact emulation) or, with NCCL's native FP8 sum, whose final code is at the max.
"""

from __future__ import annotations

import torch

from ..parallel import collectives as C


def arm(reducer, step: int, interval: int) -> bool:
    """Start collecting for optimizer step ``step`` (0-based) when ``(step + 1) % interval == 0``; returns
    whether it did (a reducer without a low-precision codec appends nothing, and :func:`collect` returns ``{}``)."""
    if interval <= 0 or (step + 1) % interval:
        return False
    reducer.telemetry = []
    return True


def collect(reducer, dp_group, dp_size: int) -> dict[str, float]:
    """Disarm and return ``{"comm/<name>": DP mean}`` (one all-reduce; collective over the DP group: every DP
    rank must call it after the same armed step). ``rel_err/...`` entries carry squared norms (the value is
    ``sqrt(num / den)``), ``bound_hits/...`` entries counts (the value is ``num / den``)."""
    items, reducer.telemetry = reducer.telemetry or [], None
    if not items:
        return {}
    num = torch.stack([n for _, n, _ in items]).double()
    den = torch.stack([d for _, _, d in items]).double()
    ratio = torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros_like(num))
    squared = torch.tensor([name.startswith("rel_err/") for name, _, _ in items], device=ratio.device)
    rel = torch.where(squared, ratio.sqrt(), ratio)
    C.all_reduce(rel, dp_group)
    rel = rel / dp_size
    return {f"comm/{name}": v for (name, _, _), v in zip(items, rel.tolist())}
