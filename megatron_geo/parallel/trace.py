"""Named ranges for ``torch.profiler`` traces (``profiling.steps``), free when no profiler runs.

The reduction path marks its phases with :func:`trace_range` so that a trace shows where a step's time goes: the
names are :data:`RANGE_NAMES` (``encode``, ``collective``, ``decode``, ``transform``, ``optimizer``). A range is a
``torch.autograd.profiler.record_function`` while a profiler records, and one shared do-nothing context manager
otherwise, so an unprofiled step makes no ``record_function`` call and allocates nothing for its ranges.

Never open a range inside a function that ``torch.compile`` traces (the codecs' encode and decode may be compiled,
``megatron_geo.comm.compiled``): wrap the call of the compiled function instead.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

RANGE_NAMES = ("encode", "collective", "decode", "transform", "optimizer")
"""The named ranges of the reduction path: ``encode`` (quantising a bucket for the wire, scales included),
``collective`` (the gradient path's and the parameter gather's reduce-scatter / all-to-all / all-gather /
all-reduce calls and their waits), ``decode`` (codes back to FP32 and the FP32 sum over ranks), ``transform``
(the GeoFP8 / Hadamard coordinate change, its inverse and GeoFP8's refresh), ``optimizer`` (the update of the
main params)."""

NO_RANGE: AbstractContextManager[None] = contextlib.nullcontext()
"""The shared do-nothing range (reusable and re-entrant): what :func:`trace_range` returns while no profiler runs,
also for call sites whose range applies only to some configurations."""


def trace_range(name: str) -> AbstractContextManager:
    """A context manager marking the code it encloses as the range ``name`` in a ``torch.profiler`` trace.

    ``torch.autograd.profiler.record_function(name)`` (a CPU-side ``user_annotation`` event, and on CUDA also a
    ``gpu_user_annotation`` over the kernels it launched) while a profiler is recording, checked with
    ``torch.autograd._profiler_enabled()`` (one C call); otherwise :data:`NO_RANGE`, with no allocation and no
    ``record_function`` call.

    Args:
        name: the event's name, one of :data:`RANGE_NAMES` on the reduction path.

    Returns:
        A context manager; use it as ``with trace_range("encode"): ...``.
    """
    if torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return NO_RANGE
