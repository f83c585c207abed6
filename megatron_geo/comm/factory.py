"""The reducer for a ``comm`` config section: :func:`build_reducer`, the one place that knows every reducer class.

It sits above the wire-format registry (:mod:`.formats`) and the reducers (:mod:`.reducer`, :mod:`.lowp`), which
never import it.
"""

from __future__ import annotations

import torch

from ..config.schema import CommConfig
from ..parallel import ParallelContext
from .formats import get_format
from .lowp import LowPrecisionReducer
from .reducer import CastReducer, FP32Reducer, Reducer


def build_reducer(comm: CommConfig | str, pctx: ParallelContext, seed: int = 0, device=None) -> Reducer:
    """The reducer for a ``comm`` config section, taken whole (or just a ``comm.dtype`` string: that dtype with the
    section's defaults).

    fp32 / bf16 with ``comm.transform=none`` -> :class:`~.reducer.FP32Reducer` / :class:`~.reducer.CastReducer`;
    every other registered format (and fp32 / bf16 behind a transform) -> :class:`~.lowp.LowPrecisionReducer`,
    which reads the section's scaling, rounding, error feedback, transform, scale sync, reduce op and compile keys.

    Args:
        comm: a :class:`~megatron_geo.config.schema.CommConfig` (or anything with its attributes), or a dtype (str).
        pctx: the parallel context; the reducer works on its DP group (``pctx.dp_group``, None: the default group)
            of ``pctx.dp_size`` ranks, as DP rank ``pctx.dp_rank``. Its ``device`` is not used (see ``device``).
        seed: int; Hadamard signs and stochastic rounding (low-precision reducers only).
        device: where the reducer's constants and generator live (None: CPU).

    Raises:
        ValueError: an unknown ``comm.dtype`` (the message lists the registered formats).
        ConfigError: settings the format cannot honour (:meth:`.formats.WireFormat.check`).
    """
    if isinstance(comm, str):
        comm = CommConfig(dtype=comm)
    dp_group, dp_size, dp_rank = pctx.dp_group, pctx.dp_size, pctx.dp_rank
    get_format(comm.dtype).check(comm)
    plain = comm.transform == "none"
    if comm.dtype == "fp32" and plain:
        return FP32Reducer(dp_group, dp_size, dp_rank)
    if comm.dtype == "bf16" and plain:
        r = CastReducer(dp_group, dp_size, dp_rank, torch.bfloat16)
        r.name = "bf16"
        return r
    return LowPrecisionReducer(comm, dp_group, dp_size, dp_rank, seed=seed, device=device)
