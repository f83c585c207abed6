"""Gradient reducers behind one interface (``comm.dtype``)."""

from .factory import build_reducer
from .reducer import CastReducer, FP32Reducer, PendingReduction, Reducer

__all__ = ["CastReducer", "FP32Reducer", "PendingReduction", "Reducer", "build_reducer"]
