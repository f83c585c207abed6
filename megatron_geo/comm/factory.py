"""``build_reducer``: the reducer for a ``comm`` config section (the only place that knows every reducer class;
the base class in :mod:`.reducer` knows no subclass)."""

from __future__ import annotations

import torch

from .lowp import LowPrecisionReducer
from .reducer import CastReducer, FP32Reducer, Reducer


def build_reducer(comm, dp_group, dp_size: int, dp_rank: int, seed: int = 0, device=None) -> Reducer:
    """The reducer for a ``comm`` config section (or just a ``comm.dtype`` string).

    fp32 -> :class:`FP32Reducer`; bf16 -> :class:`CastReducer`; fp8_e4m3 / fp8_e5m2 / nvfp4 ->
    :class:`~megatron_geo.comm.lowp.LowPrecisionReducer` with the section's scaling, rounding, error
    feedback, transform and scale sync.

    Raises:
        ValueError: an unknown ``comm.dtype``.
    """
    dtype = comm if isinstance(comm, str) else comm.dtype
    plain = isinstance(comm, str) or comm.transform == "none"
    if dtype == "fp32" and plain:
        return FP32Reducer(dp_group, dp_size, dp_rank)
    if dtype == "bf16" and plain:
        r = CastReducer(dp_group, dp_size, dp_rank, torch.bfloat16)
        r.name = "bf16"
        return r
    if dtype in ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4"):
        kw = {} if isinstance(comm, str) else dict(
            scaling=comm.scaling, block_size=comm.block_size, rounding=comm.rounding,
            error_feedback=comm.error_feedback, transform=comm.transform, hadamard_block=comm.hadamard_block,
            scale_sync=comm.scale_sync, compile=comm.compile, reduce_op=comm.reduce_op,
            wire_sum_prediv=comm.wire_sum_prediv)
        return LowPrecisionReducer(dp_group, dp_size, dp_rank, dtype, seed=seed, device=device, **kw)
    raise ValueError(f"comm.dtype={dtype!r} is not supported; choose fp32, bf16, fp8_e4m3, fp8_e5m2 or nvfp4")
