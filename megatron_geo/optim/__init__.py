"""Optimizer helpers (Muon with a CPU-friendly Newton-Schulz precision and the Gram form of the iteration)."""

from .muon import (
    NS_CHOICES,
    NS_DTYPES,
    MuonNS,
    NSSettings,
    build_muon,
    gram_newton_schulz,
    gram_restarts,
    newton_schulz5,
    newton_schulz_dtype,
    orthogonalize,
)

__all__ = [
    "NS_CHOICES",
    "NS_DTYPES",
    "MuonNS",
    "NSSettings",
    "build_muon",
    "gram_newton_schulz",
    "gram_restarts",
    "newton_schulz5",
    "newton_schulz_dtype",
    "orthogonalize",
]
