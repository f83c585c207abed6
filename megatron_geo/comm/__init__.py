"""Gradient reducers behind one interface (``comm.dtype``)."""

from .reducer import CastReducer, FP32Reducer, PendingReduction, Reducer, build_reducer

__all__ = ["CastReducer", "FP32Reducer", "PendingReduction", "Reducer", "build_reducer"]
