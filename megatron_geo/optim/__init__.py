"""Optimizer helpers (Muon with a CPU-friendly Newton-Schulz precision)."""

from .muon import MuonNS, build_muon, newton_schulz5

__all__ = ["MuonNS", "build_muon", "newton_schulz5"]
