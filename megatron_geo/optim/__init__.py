"""Optimizer helpers (Muon with a CPU-friendly Newton-Schulz precision and the Gram form of the iteration)."""

from .muon import NS_CHOICES, MuonNS, build_muon, gram_newton_schulz, gram_restarts, newton_schulz5, orthogonalize

__all__ = [
    "NS_CHOICES",
    "MuonNS",
    "build_muon",
    "gram_newton_schulz",
    "gram_restarts",
    "newton_schulz5",
    "orthogonalize",
]
